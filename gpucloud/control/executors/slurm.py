"""The Slurm executor: each workload is one Slurm job on the nodes our scheduler chose.

Slurm's own commands are the whole interface (`sinfo`, `sbatch`, `squeue`, `scancel`), run
with timeouts: they block for long when slurmctld does not answer. The cluster is the one
SLURM_CONF names (else Slurm's default config). A handle's token is the Slurm job id.

Every node's task is the sandbox's runner (gpucloud.control.sandbox.run; see slurm_batch):
the workload runs as its tenant's user, in its namespaces and cgroups, as under the local
executor. Slurm's proctrack/cgroup keeps tracking the runner, which stays in Slurm's step
cgroup, forwards Slurm's signals and takes the workload along when Slurm kills it; the
workload itself moves into the sandbox's cgroups (memory, cpu, pids, freezer), whose limits
are the ones that apply. Tested with cgroup v1, ProctrackType=proctrack/cgroup and
TaskPlugin=task/none (with task/cgroup, untested here, the workload would leave Slurm's
task cgroups likewise: its /dev is the sandbox's, which shows its GPUs only); a 2-node gang
tested with two slurmds on one machine under proctrack/linuxproc.

While slurmctld does not answer, nothing is taken to have changed: the last inventory
stands and running workloads stay running, rather than failing over a whole cluster
because its controller restarts.

A job that Slurm itself ends or requeues — its node failed, Slurm preempted it, an operator
ran `scontrol requeue` — is reported as lost (`Exit.lost`): the control plane requeues it
without using one of its retries, our scheduler places it again, and the job resumes from
its checkpoint. Slurm's own requeued copy is cancelled, so that the control plane stays the
one place that decides what runs where (Slurm would otherwise rerun it on the same nodes,
dead or not).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpucloud import hardware
from gpucloud.control.executors.base import (
    Exit,
    Handle,
    Launch,
    NodeInfo,
    StartError,
    last_line,
)
from gpucloud.control.executors.slurm_batch import (
    batch_script,
    sandbox_spec,
    sbatch_args,
    spec_file,
)
from gpucloud.control.sandbox import SETUP_FAILED, scope_for
from gpucloud.control.sandbox.run import write_spec_file
from gpucloud.errors import GpucloudError

if TYPE_CHECKING:
    from gpucloud.control.config import Settings

log = logging.getLogger(__name__)

COMMAND_TIMEOUT = 30.0  # seconds a Slurm command may take
_ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
    "RESIZING",
}
_CANCELLABLE = {"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED"}
_REQUEUED = {"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT"}
# Ended by Slurm, not by the workload: a lost attempt.
_LOST = {"NODE_FAIL": "its node failed", "PREEMPTED": "preempted by Slurm", "BOOT_FAIL": ""}
_REASONS = {
    "TIMEOUT": "time limit reached",
    "OUT_OF_MEMORY": "out of memory",
    "CANCELLED": "cancelled in Slurm",
    "DEADLINE": "deadline reached",
}
_UNHEALTHY_STATES = {"down", "unknown", "future"}
# NOT_RESPONDING is not among them: it comes and goes with a missed ping; Slurm declares a
# node that stays silent DOWN after its SlurmdTimeout, and that is the verdict we follow.
_UNHEALTHY_FLAGS = {"DRAIN", "FAIL", "MAINTENANCE", "REBOOT_REQUESTED"}
_GRES_GPU = re.compile(r"(?:^|,)gpu(?::([^:(,]+))?:(\d+)")


class SlurmError(GpucloudError):
    """A Slurm command failed or timed out."""


@dataclass
class _Snapshot:
    taken: float
    jobs: dict[str, dict]


class SlurmExecutor:
    name = "slurm"
    telemetry = None  # device telemetry of its nodes is not read

    def __init__(
        self,
        settings: Settings,
        inventory_ttl: float = 2.0,
        queue_ttl: float = 1.0,
        unreachable_backoff: float = 10.0,
    ) -> None:
        """The cluster is the one Slurm's commands find (SLURM_CONF, else Slurm's default
        config); `settings.gpu_type` is the catalog type of GPUs whose GRES names no type
        the catalog knows. Inventory and queue are read at most every `inventory_ttl` and
        `queue_ttl` seconds; after slurmctld failed to answer, no command is tried for
        `unreachable_backoff` seconds."""
        self.gpu_type = hardware.get(settings.gpu_type).name
        self.scope = scope_for(settings.home)  # the cgroups of its workloads, on every node
        self.logs_dir = settings.logs_dir
        self._inventory_ttl = inventory_ttl
        self._queue_ttl = queue_ttl
        self._nodes: list[NodeInfo] = []
        self._nodes_at = -float("inf")
        self._queue = _Snapshot(-float("inf"), {})
        self._config_cache: dict[str, str] | None = None
        self._backoff = unreachable_backoff
        self._unreachable_until = -float("inf")

    # -- commands

    def _run(self, *args: str) -> str:
        """Run a Slurm command; raises SlurmError. After slurmctld failed to answer, every
        command fails at once for a while (`unreachable_backoff`) rather than block a reconciler
        pass for a client timeout per workload."""
        if time.monotonic() < self._unreachable_until:
            raise SlurmError(f"{args[0]}: slurmctld did not answer a moment ago")
        try:
            out = subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._unreachable()
            raise SlurmError(f"{args[0]}: no answer in {COMMAND_TIMEOUT:g} s") from None
        except OSError as e:
            raise SlurmError(f"{args[0]}: {e}") from None
        if out.returncode != 0:
            if "Unable to contact slurm controller" in out.stderr:
                self._unreachable()
            raise SlurmError(f"{args[0]}: {out.stderr.strip() or f'exit code {out.returncode}'}")
        return out.stdout

    def _unreachable(self) -> None:
        self._unreachable_until = time.monotonic() + self._backoff

    def _json(self, *args: str) -> dict:
        """A command's --json output. Slurm 22.05 exits 0 with an empty list and `errors`
        when slurmctld does not answer: that is an error here, not an empty cluster."""
        try:
            data = json.loads(self._run(*args, "--json"))
        except ValueError as e:
            raise SlurmError(f"{args[0]} --json printed no JSON: {e}") from None
        if data.get("errors"):
            self._unreachable()
            raise SlurmError(f"{args[0]}: {data['errors']}")
        return data

    # -- inventory

    def inventory(self) -> list[NodeInfo]:
        """Every node with its GPUs, CPUs, memory and health; read from
        `sinfo --json` at most every `inventory_ttl` seconds."""
        if time.monotonic() - self._nodes_at < self._inventory_ttl:
            return self._nodes
        try:
            data = self._json("sinfo")
        except SlurmError as e:
            log.warning("Slurm inventory unavailable, keeping the last one: %s", e)
            return self._nodes
        self._nodes = [self._node_info(n) for n in data.get("nodes", [])]
        self._nodes_at = time.monotonic()
        return self._nodes

    def _node_info(self, node: dict) -> NodeInfo:
        gres_type, gpus = gpu_gres(node.get("gres") or "")
        gpu_type, known = self._catalog_type(gres_type)
        healthy, reason = node_health(node)
        labels = {"slurm-gres-type": gres_type} if gres_type and not known else {}
        if node.get("partitions"):
            labels["slurm-partitions"] = ",".join(node["partitions"])
        if node.get("features"):
            labels["slurm-features"] = node["features"]
        return NodeInfo(
            name=node["name"],
            gpu_type=gpu_type,
            gpus=gpus,
            backend=_backend(gpu_type) if gpus else "cpu",
            address=node.get("address") or node["name"],
            cpu_milli=int(node.get("cpus") or 0) * 1000,
            memory_mib=int(node.get("real_memory") or 0),
            labels=labels,
            healthy=healthy,
            reason=reason,
        )

    def _catalog_type(self, gres_type: str | None) -> tuple[str, bool]:
        if gres_type:
            try:
                return hardware.get(gres_type).name, True
            except GpucloudError:
                pass
        return self.gpu_type, False

    # -- start

    def start(self, launch: Launch) -> Handle:
        """Submit the launch as one batch job on its placement, its sandbox spec beside its
        log; its output is appended to `launch.log_path` (made 0600 here). Raises
        StartError when sbatch refuses it."""
        args = sbatch_args(launch)
        script = batch_script(launch)
        spec, inherit = sandbox_spec(launch)
        try:
            launch.log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(launch.log_path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600))
            write_spec_file(spec_file(launch), self.scope, spec, inherit)
            with tempfile.NamedTemporaryFile("w", prefix="gpucloud-sbatch-", suffix=".sh") as f:
                f.write(script)  # mkstemp: 0600, so its secrets stay the control plane's
                f.flush()
                job_id = self._run("sbatch", *args, f.name).strip().split(";")[0]
        except (OSError, SlurmError) as e:
            raise StartError(str(e)) from e
        if not job_id.isdigit():
            raise StartError(f"sbatch printed no job id: {job_id!r}")
        return Handle(launch.ref, job_id)

    # -- poll

    def poll(self, handle: Handle) -> Exit | None:
        """None while the job is queued or runs (or slurmctld does not answer); its Exit
        once it ended. A job Slurm requeued is cancelled and reported lost."""
        try:
            job = self._job(handle.token)
        except SlurmError as e:
            log.warning("cannot poll Slurm job %s of %s: %s", handle.token, handle.ref, e)
            return None
        if job is None:
            return self._why(handle, self._from_jobcomp(handle.token))
        state = job["job_state"]
        if job.get("restart_cnt") or state in _REQUEUED:
            if state in _CANCELLABLE:  # Slurm's copy, queued again or rerunning: ours to end
                self._cancel(handle.token)
            if state == "CANCELLED":
                restarts = job.get("restart_cnt")
                return Exit(None, f"requeued by Slurm (restart {restarts})", lost=True)
        if state in _ACTIVE or state in _REQUEUED:
            return None
        ended = job_exit(job["job_state"], job.get("exit_code"), job.get("state_reason"))
        return self._why(handle, ended)

    def _why(self, handle: Handle, ended: Exit) -> Exit:
        """A workload whose sandbox could not be set up on its node says why, as the local
        executor's do: the set-up's last words are the last line of its log."""
        if ended.code == SETUP_FAILED and ended.reason is None:
            why = last_line(self.logs_dir / f"{handle.ref}.log", starting="gpucloud sandbox:")
            return Exit(None, f"could not start: {why}")
        return ended

    def _job(self, job_id: str, fresh: bool = False) -> dict | None:
        """The job's record in `squeue --json` (one snapshot of every job, shared by the
        polls of a pass: squeue 22.05 ignores its filters with --json); None when Slurm no
        longer lists it. A job missing from a cached snapshot is looked up afresh."""
        stale = time.monotonic() - self._queue.taken >= self._queue_ttl
        if not (fresh or stale) and job_id in self._queue.jobs:
            return self._queue.jobs[job_id]
        data = self._json("squeue", "--states=all")
        self._queue = _Snapshot(time.monotonic(), {str(j["job_id"]): j for j in data["jobs"]})
        return self._queue.jobs.get(job_id)

    def _from_jobcomp(self, job_id: str) -> Exit:
        """How a job slurmctld has forgotten ended, from the job-completion log (when Slurm
        writes one, jobcomp/filetxt, and it is readable here)."""
        record = _last_record(self._jobcomp_path(), job_id)
        if record is None:
            return Exit(None, f"Slurm no longer knows job {job_id}", lost=True)
        state = record.get("JobState", "")
        if state in _ACTIVE or state in _REQUEUED:  # the record of a requeue
            return Exit(None, f"requeued by Slurm ({state})", lost=True)
        code, _, sig = record.get("ExitCode", "").partition(":")
        status = (int(code) << 8 if code.isdigit() else 0) | (int(sig) if sig.isdigit() else 0)
        return job_exit(state, status if code.isdigit() else None, None)

    def _jobcomp_path(self) -> Path | None:
        config = self._config()
        if config.get("JobCompType") != "jobcomp/filetxt" or not config.get("JobCompLoc"):
            return None
        return Path(config["JobCompLoc"])

    def _kill_wait(self) -> float:
        """Seconds Slurm waits between a cancelled job's SIGTERM and its SIGKILL."""
        words = self._config().get("KillWait", "").split()
        return float(words[0]) if words and words[0].isdigit() else 30.0  # Slurm's default

    def _config(self) -> dict[str, str]:
        """`scontrol show config` as a dict (read once: it changes with a restart only)."""
        if self._config_cache is None:
            try:
                out = self._run("scontrol", "show", "config")
            except SlurmError:
                return {}  # asked again next time
            fields = (line.partition("=") for line in out.splitlines())
            self._config_cache = {k.strip(): v.strip() for k, _, v in fields}
        return self._config_cache

    # -- stop

    def stop(self, handle: Handle, grace: float) -> Exit:
        """SIGTERM every task on every node; after `grace` seconds cancel the job, which
        Slurm does by SIGTERM again and SIGKILL its KillWait seconds later (`scancel
        --signal=KILL` is a cancel too: Slurm has no quicker kill). Returns once Slurm lists
        the job as ended, its nodes free."""
        job = self._job(handle.token, fresh=True)
        if job is not None and job["job_state"] == "RUNNING":
            self._cancel(handle.token, "--signal=TERM")
            self._wait_ended(handle.token, grace)
        self._cancel(handle.token)
        self._wait_ended(handle.token, COMMAND_TIMEOUT + self._kill_wait())
        unconfirmed = Exit(None, f"Slurm did not confirm that job {handle.token} ended")
        return self.poll(handle) or unconfirmed

    def _cancel(self, job_id: str, *args: str) -> None:
        try:
            self._run("scancel", *args, job_id)
        except SlurmError as e:  # it ended meanwhile: what the caller waits for
            log.info("scancel %s %s: %s", " ".join(args), job_id, e)

    def _wait_ended(self, job_id: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(SlurmError):  # slurmctld away: not known to be ended
                job = self._job(job_id, fresh=True)
                if job is None or job["job_state"] not in _ACTIVE:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def close(self) -> None:
        """Nothing to release: the jobs are Slurm's and keep running."""


def gpu_gres(gres: str) -> tuple[str | None, int]:
    """The GPU type and count of a node's GRES ('gpu:a100:4(S:0-1)' → ('a100', 4)); with
    GPUs of several types, the most numerous type's."""
    found = [(int(n), t) for t, n in _GRES_GPU.findall(gres)]
    if not found:
        return None, 0
    count, gpu_type = max(found)
    return gpu_type or None, count


def node_health(node: dict) -> tuple[bool, str | None]:
    """Unhealthy when Slurm has it down, draining or failing; the reason is Slurm's."""
    flags = set(node.get("state_flags") or []) & _UNHEALTHY_FLAGS
    state = str(node.get("state", "")).lower()
    if state not in _UNHEALTHY_STATES and not flags:
        return True, None
    what = " ".join([state.upper(), *sorted(flags)])
    return False, f"{what}: {node['reason']}" if node.get("reason") else what


def job_exit(state: str, status: int | None, slurm_reason: str | None) -> Exit:
    """The Exit of an ended job from its state and wait status (exit code << 8 | signal)."""
    code = None
    if status is not None and state != "CANCELLED":  # a cancelled job's is srun's, not its
        code = 128 + (status & 0x7F) if status & 0x7F else status >> 8
    if state in _LOST:
        return Exit(code, _LOST[state] or f"Slurm: {state}", lost=True)
    reason = _REASONS.get(state)
    if reason is None and slurm_reason not in (None, "None", "NonZeroExitCode"):
        reason = f"Slurm: {slurm_reason}"
    return Exit(code, reason)


def _backend(gpu_type: str) -> str:
    """Huawei's NPUs run on torch_npu; NVIDIA, AMD and Hygon GPUs on torch's cuda device."""
    return "npu" if hardware.get(gpu_type).vendor == "huawei" else "cuda"


def _last_record(path: Path | None, job_id: str) -> dict[str, str] | None:
    """The last jobcomp/filetxt line of the job, as its Key=Value fields."""
    if path is None:
        return None
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    prefix = f"JobId={job_id} "
    for line in reversed(lines):
        if line.startswith(prefix):
            return dict(f.partition("=")[::2] for f in line.split() if "=" in f)
    return None
