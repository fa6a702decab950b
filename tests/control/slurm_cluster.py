"""A throwaway Slurm cluster for tests: slurmctld + a slurmd per node on 127.0.0.1 in a temp dir.

No munge (auth/none), no slurmdbd (finished jobs are read from jobcomp/filetxt), fake GPUs:
`gres.conf` points at character devices made with mknod in the temp dir (a count-only GRES
drains the node, and /dev/null's numbers break job launch under the cgroup plugins). Each
cluster has its own name, ports and first job id, so two test runs on one machine do not
meet; its daemons are stopped by pid, never by name. Clients reach it through SLURM_CONF.

Several nodes are several slurmds on this machine (`slurmd -N NAME`), each on a port of its
own, with its own spool, pid and log files (`%n`: the node's name). Debian's build is not
one for several slurmds per machine, whose cgroups would carry the node's name: the steps
of one job on two nodes would share a cgroup, so such a cluster tracks processes by their
parentage (proctrack/linuxproc) instead.

Debian's slurm-wlm (`make test` installs it: tests/install_system_packages.sh); the daemons
run as root (their jobs run as the submitting user).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

GPUS = 4
GPU_TYPE = "a100"
CPUS = 2
MEMORY_MIB = 4096
_DEVICE_MAJOR = 240  # a "local/experimental" major number: no real driver owns it


def slurm_installed() -> bool:
    return all(shutil.which(c) for c in ("slurmctld", "slurmd", "sbatch", "squeue"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """`nodes` nodes (`self.nodes`; `self.node` the first) with GPUS fake GPUs of GPU_TYPE
    each, CPUS cores, MEMORY_MIB."""

    def __init__(self, nodes: int = 1) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpucloud-slurm-"))
        self.dir.chmod(0o755)  # slurmd's job steps read the conf and devices from here
        tag = f"{random.randrange(16**6):06x}"
        self.name = f"gpuc{tag}"
        self.node = f"n{tag}"
        self.nodes = [self.node] + [f"n{tag}-{i}" for i in range(1, nodes)]
        self.conf = self.dir / "slurm.conf"
        self.jobcomp = self.dir / "jobcomp.txt"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        self._write_config()
        self.start_daemon("slurmctld")
        for node in self.nodes:
            self.start_daemon("slurmd", "-N", node)
        self._wait_idle()

    def start_daemon(self, daemon: str, *args: str) -> None:
        key = "-".join([daemon, *args[1:]]) if len(self.nodes) > 1 else daemon
        log = open(self.dir / f"{key}.out", "ab")  # noqa: SIM115 (the daemon keeps it)
        cmd = [daemon, "-D", *args]  # -D: in the foreground, so its pid is ours to stop
        self._daemons[key] = subprocess.Popen(
            cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def stop_daemon(self, daemon: str) -> None:
        """SIGTERM the daemon, SIGKILL after 10 s."""
        p = self._daemons.pop(daemon)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def _write_config(self) -> None:
        for sub in ("state", "spool", "dev"):
            (self.dir / sub).mkdir()
        gres = []
        for n, node in enumerate(self.nodes):
            for i in range(n * GPUS, (n + 1) * GPUS):
                dev = self.dir / "dev" / f"gpu{i}"
                os.mknod(dev, 0o666 | 0o020000, os.makedev(_DEVICE_MAJOR, i))
                gres.append(f"NodeName={node} Name=gpu Type={GPU_TYPE} File={dev}\n")
        (self.dir / "gres.conf").write_text("".join(gres))
        several = len(self.nodes) > 1
        node_files = "-%n" if several else ""
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        d = self.dir
        self.conf.write_text(
            "\n".join(
                [
                    f"ClusterName={self.name}",
                    f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    # job ids (and the cgroups named after them) unlike another run's
                    f"FirstJobId={random.randrange(1000, 50_000_000)}",
                    "AuthType=auth/none",
                    "CredType=cred/none",
                    "AuthInfo=cred_expire=5",  # else a requeued job waits 120 s
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"StateSaveLocation={d}/state",
                    f"SlurmdSpoolDir={d}/spool{node_files}",
                    f"SlurmctldPidFile={d}/slurmctld.pid",
                    f"SlurmdPidFile={d}/slurmd{node_files}.pid",
                    f"SlurmctldLogFile={d}/slurmctld.log",
                    f"SlurmdLogFile={d}/slurmd{node_files}.log",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    "MailProg=/bin/true",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core_Memory",
                    "DefMemPerCPU=256",  # else each job takes the node's whole memory
                    "GresTypes=gpu",
                    # cgroup: kills double-forked children too
                    f"ProctrackType=proctrack/{'linuxproc' if several else 'cgroup'}",
                    "TaskPlugin=task/none",
                    "JobCompType=jobcomp/filetxt",
                    f"JobCompLoc={self.jobcomp}",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "SchedulerType=sched/backfill",
                    "SchedulerParameters=sched_interval=1",
                    "KillWait=2",  # seconds from a cancel's SIGTERM to its SIGKILL
                    "MessageTimeout=3",  # how long clients retry a silent slurmctld
                    "MinJobAge=600",  # ended jobs stay visible in squeue for the tests
                    "SlurmdParameters=config_overrides",
                    *(
                        f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()}"
                        f"{f' Port={_free_port()}' if several else ''} CPUs={CPUS}"
                        f" RealMemory={MEMORY_MIB} Gres=gpu:{GPU_TYPE}:{GPUS} State=UNKNOWN"
                        for node in self.nodes
                    ),
                    f"PartitionName=gpu Nodes={','.join(self.nodes)} Default=YES"
                    " MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def run(self, *args: str, check: bool = True) -> str:
        """A client command against this cluster (clients block for long when slurmctld is
        down: hence the timeout)."""
        out = subprocess.run(
            args, env=self.env, capture_output=True, text=True, timeout=30, check=False
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip()}\n{self.logs()}")
        return out.stdout

    def _wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for p in self._daemons.values():
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited {p.returncode}\n{self.logs()}")
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%T", "-n", ",".join(self.nodes)],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=15,
                check=False,
            )
            state = out.stdout.split()
            if state == ["idle"] * len(self.nodes):
                return
            time.sleep(0.2)
        raise RuntimeError(f"nodes {self.nodes} not idle after {timeout} s: {state}\n{self.logs()}")

    def _cancel_all(self, timeout: float = 30) -> None:
        """Cancel every job of this cluster (all are this test run's) and wait until none
        is left running."""
        self.run("scancel", f"--user={os.getuid()}", check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.run("squeue", "-h", "-o", "%T", check=False).split()
            if not set(states) & {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING"}:
                return
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for path in sorted(self.dir.glob("slurm*.log")) + sorted(self.dir.glob("slurm*.out")):
            if path.exists():
                parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel its jobs (a stopped slurmd leaves its jobs' step daemons and tasks
        running), stop its daemons (slurmd first), then remove the temp dir."""
        if len(self._daemons) == 1 + len(self.nodes):  # none stopped by a test
            self._cancel_all()
        for daemon in reversed(list(self._daemons)):
            self.stop_daemon(daemon)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running(nodes: int = 1) -> Iterator[SlurmCluster]:
    """A started cluster for a test module, stopped after it (skips without slurm-wlm)."""
    if not slurm_installed():
        pytest.skip("Slurm is not installed (make test installs slurm-wlm)")
    cluster = SlurmCluster(nodes)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
