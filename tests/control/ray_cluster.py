"""A real multi-node Ray cluster on this machine, for the Ray tier (`pytest -m ray`).

A head node (no accelerators, so nothing of ours runs there) on 127.0.0.1 and worker nodes
that each declare fake accelerators as the custom resource `accel_<TYPE>` and carry the
label role=worker, each on a loopback address of its own (127.0.0.2, 127.0.0.3, ...), as
machines have theirs. Each node is one `ray start --block` in its own process
group (its session): stopping a node signals that group, and killing a node's raylet
alone simulates a machine that died.

The whole tier runs in a network namespace of its own (`own_network`): the test's thread
moves into a fresh namespace with only loopback up before it starts anything, so every
Ray process, control plane and client it starts talks over a private 127.0.0.1 — no port
clashes with other Ray clusters on the machine, no traffic off it — and moves back at the
end. Never `ray stop`: it kills every Ray process on the machine by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).parent / "ray")
CLONE_NEWNET = 0x40000000
MIB = 1024 * 1024
# The head declares a node dead after 3 missed 1 s health checks (default: 14 s).
_HEAD_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
# No idle Python workers started ahead of use (each costs ~100 MB); no usage reporting.
_NODE_ENV = {
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}


@contextlib.contextmanager
def own_network() -> Iterator[None]:
    """Run the calling thread — and every thread and process it starts meanwhile — in a
    fresh network namespace with loopback up; back in the original one at the end.
    Needs CAP_SYS_ADMIN (root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET): the Ray tier needs root")
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        yield
    finally:
        if libc.setns(original, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back to the original network namespace")
        os.close(original)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_address(i: int) -> str:
    """The address of worker node `i` (every 127.x.y.z is this machine's loopback)."""
    return f"127.0.0.{2 + i}"


class Node:
    """One `ray start --block` and the processes it started (its process group)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def processes(self) -> list[psutil.Process]:
        """Every live process of this node: its process group, and its descendants."""
        found = {}
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                found[p.pid] = p
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):  # gone meanwhile
                if os.getpgid(p.pid) == self.proc.pid:
                    found[p.pid] = p
        return list(found.values())

    def raylet(self) -> psutil.Process:
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                if p.name() == "raylet":
                    return p
        raise LookupError(f"node {self.name} has no raylet")

    def node_id(self) -> str:
        """Ray's id of this node (its raylet's --node_id)."""
        args = self.raylet().cmdline()
        return next(a.partition("=")[2] for a in args if a.startswith("--node_id="))

    def kill_raylet(self) -> None:
        """The machine dies: SIGKILL its raylet (what Ray notices), and every other process
        of the node with it."""
        procs = self.processes()  # before its raylet dies: its workers stay its descendants
        self.raylet().kill()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.proc.wait()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the node's processes, SIGKILL what is left after `grace` (gcs_server
        ignores SIGTERM at times)."""
        procs = self.processes()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=grace)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=grace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace)


class RayCluster:
    """A head and `workers` worker nodes, each with `gpus` fake accelerators of
    `gpu_type`. Use inside `own_network()`."""

    def __init__(
        self, workers: int = 2, gpus: int = 2, gpu_type: str = "A100", quick_death: bool = True
    ) -> None:
        """`quick_death`: the head declares a node dead within ~3 s instead of Ray's
        default ~15 s or more."""
        self.workers, self.gpus, self.gpu_type = workers, gpus, gpu_type
        self.quick_death = quick_death
        # Short: Ray's Unix sockets live under it, and their paths are limited to 107 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.head: Node | None = None
        self.nodes: list[Node] = []  # the workers, in start order

    def start(self, timeout: float = 60.0) -> RayCluster:
        head = ["--head", f"--port={self.port}", "--num-cpus=0", "--include-dashboard=false"]
        self.head = self._node("head", "127.0.0.1", head)
        for i in range(self.workers):
            self.start_worker(i)
        self.wait_nodes(1 + self.workers, timeout)
        return self

    def start_worker(self, i: int) -> Node:
        resources = json.dumps({f"accel_{self.gpu_type}": self.gpus})
        node = self._node(
            f"w{i}",
            worker_address(i),
            [
                f"--address={self.address}",
                f"--resources={resources}",
                "--labels=role=worker",
                "--num-cpus=4",
                f"--memory={8 * 1024 * MIB}",
            ],
        )
        self.nodes.append(node)
        return node

    def wait_nodes(self, n: int, timeout: float = 60.0) -> None:
        """Wait until the cluster has exactly `n` nodes alive."""
        out = subprocess.run(
            [sys.executable, "-c", _WAIT_ALIVE, self.address, str(n), str(timeout)],
            capture_output=True,
            text=True,
            env=self._env(),
        )
        if out.returncode != 0:
            raise TimeoutError(f"Ray cluster: not {n} nodes alive\n{out.stderr}\n{self}")

    def groups(self) -> list[dict]:
        """Ray's placement groups (removed ones too): name, state, where the bundles are."""
        return self._ask(_GROUPS)

    def actors(self) -> list[str]:
        """The names of the live named actors of gpucloud's namespace (the launchers)."""
        return self._ask(_ACTORS)

    def _ask(self, script: str):
        """What `script`, a driver of its own, prints about this cluster (as JSON)."""
        out = subprocess.run(
            [sys.executable, "-c", script, self.address],
            capture_output=True,
            text=True,
            env=self._env(),
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def _node(self, name: str, ip: str, args: list[str]) -> Node:
        temp = self.root / name
        temp.mkdir()
        argv = [
            RAY,
            "start",
            "--block",
            f"--node-ip-address={ip}",
            f"--object-store-memory={100 * MIB}",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
            "--include-log-monitor=false",
            *args,
        ]
        env = {**self._env(), **(_HEAD_ENV if name == "head" and self.quick_death else {})}
        return Node(name, argv, env, self.root / f"{name}.log")

    def _env(self) -> dict[str, str]:
        return {**os.environ, **_NODE_ENV}

    def stop(self) -> None:
        for node in [*self.nodes, *([self.head] if self.head else [])]:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __str__(self) -> str:
        logs = sorted(self.root.glob("*.log"))
        return "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in logs)


# Waits until the cluster at argv[1] has argv[2] nodes alive, for at most argv[3] seconds
# (a driver of its own: the test process's connection belongs to the executor under test).
_WAIT_ALIVE = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + float(sys.argv[3])
while sum(n["Alive"] for n in ray.nodes()) != int(sys.argv[2]):
    if time.monotonic() > deadline:
        sys.exit(f"alive: {[n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]}")
    time.sleep(0.2)
"""


# Prints the placement groups of the cluster at argv[1] as JSON.
_GROUPS = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
table = ray.util.placement_group_table().values()
print(json.dumps(list(table), default=str))
"""


# Prints the names of the live named actors in namespace gpucloud of the cluster at argv[1].
_ACTORS = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace="gpucloud", logging_level="ERROR", log_to_driver=False)
print(json.dumps(sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["namespace"] == "gpucloud")))
"""
