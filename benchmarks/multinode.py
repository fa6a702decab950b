"""Many machines: how long a 2-node gang takes to start on Ray, and how fast the control
plane notices a node that died.

A real Ray cluster on this machine (a head and worker nodes with 2 fake A100s each, each
worker on a loopback address of its own, in a private network namespace:
tests/control/ray_cluster.py) and two real `gpucloud server`s on SQLite: one on that
cluster (`--executor ray`), one on the local executor with 4 virtual GPUs (the baseline,
in the same run).

- Gang start: submit a 4-GPU job whose command prints a line on each of its nodes, and
  time from the submit to every node's line in the job's log (on Ray: 2 nodes x 2 GPUs, a
  placement group and a launcher per node; locally: one process on 4 GPUs), median of
  --runs, alternating.
- Reaction: SIGKILL the raylet of a node running a 2-node gang, and time until the job is
  requeued (target <= 10 s), with Ray's default health checks (Ray itself declares the
  node dead only after ~15 s or more); a new worker node joins after each kill.

Needs root (a network namespace, tenants' uids) and Ray (`pip install gpucloud[ray]`).

    python benchmarks/multinode.py [--runs 5] [--kills 2]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' Ray cluster
from tests.control.ray_cluster import RayCluster, free_port, own_network  # noqa: E402

GANG = {"name": "gang", "command": "echo up on node ${GPUCLOUD_NODE_RANK:-0}; exec sleep 600"}
GPUCLOUD = str(Path(sys.executable).parent / "gpucloud")


class Plane:
    """A `gpucloud server` on SQLite in its own home, and an admin client for its API."""

    def __init__(self, home: Path, port: int, *extra: str) -> None:
        home.mkdir(parents=True)
        self.home, self.url = home, f"http://127.0.0.1:{port}"
        argv = [GPUCLOUD, "server", "--db", f"sqlite:///{home / 'state.db'}"]
        argv += ["--port", str(port), "--grace", "1", "--min-run", "0", *extra]
        with (home / "server.out").open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "GPUCLOUD_HOME": str(home)},
            )
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((home / "server.out").read_text())
            time.sleep(0.1)
        key = re.search(r"shown once\): (\S+)", (home / "server.out").read_text()).group(1)
        self.api = httpx.Client(
            base_url=self.url + "/api/v1", headers={"Authorization": f"Bearer {key}"}, timeout=60
        )

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def job(self, job_id: int) -> dict:
        return self.api.get(f"/jobs/{job_id}").raise_for_status().json()

    def gang_start(self, nodes: int) -> tuple[int, float]:
        """Submit the gang; its id and the seconds until every node's line is logged."""
        t0 = time.perf_counter()
        job_id = self.api.post("/jobs", json={**GANG, "gpus": 4}).raise_for_status().json()["id"]
        while self.api.get(f"/jobs/{job_id}/logs").text.count("up on node") < nodes:
            if self.job(job_id)["state"] in ("FAILED", "CANCELLED", "SUCCEEDED"):
                raise RuntimeError(f"the gang ended: {self.job(job_id)}")
            time.sleep(0.01)
        return job_id, time.perf_counter() - t0

    def cancel(self, job_id: int) -> None:
        self.api.post(f"/jobs/{job_id}/cancel").raise_for_status()
        self.wait(lambda: self.job(job_id)["state"] == "CANCELLED")
        self.wait(lambda: all(n["gpus_allocated"] == 0 for n in self.api.get("/nodes").json()))

    def wait(self, predicate, timeout: float = 120.0, interval: float = 0.05) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}: timed out")
            time.sleep(interval)

    def stop(self) -> None:
        from gpucloud.control.sandbox import Sandbox, scope_for

        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        Sandbox(scope_for(self.home)).close()  # its workloads' cgroups


def _bench(args: argparse.Namespace, root: Path) -> None:
    cluster = RayCluster(workers=2, gpus=2, gpu_type="A100", quick_death=False)
    planes: list[Plane] = []
    try:
        cluster.start()
        ray = Plane(
            root / "ray", free_port(), "--executor", "ray", "--ray-address", cluster.address
        )
        planes.append(ray)
        local = Plane(root / "local", free_port(), "--virtual-gpus", "4", "--gpu-type", "A100")
        planes.append(local)
        on_ray, on_local = [], []
        for _ in range(args.runs):
            for plane, nodes, times in ((ray, 2, on_ray), (local, 1, on_local)):
                job_id, took = plane.gang_start(nodes)
                times.append(took)
                plane.cancel(job_id)
        reactions = [_reaction(ray, cluster, 2 + i) for i in range(args.kills)]
    finally:
        for plane in planes:
            plane.stop()
        cluster.stop()
    ray_med, local_med = statistics.median(on_ray), statistics.median(on_local)
    print(f"2-node gang start, submit to every node's rank running (median of {args.runs})")
    print(
        f"  Ray executor, 2 nodes x 2 GPUs {ray_med * 1e3:8.0f} ms   local executor, 1 node x "
        f"4 GPUs {local_med * 1e3:8.0f} ms   ratio {ray_med / local_med:.1f}"
    )
    worst = max(reactions)
    met = "met" if worst <= 10 else "MISSED"
    print(
        f"node death (raylet SIGKILL) to job requeued: median "
        f"{statistics.median(reactions):.1f} s, worst {worst:.1f} s of {len(reactions)} "
        f"(target <= 10 s: {met})"
    )


def _reaction(ray: Plane, cluster: RayCluster, replacement: int) -> float:
    """Seconds from the SIGKILL of the raylet of a 2-node gang's second node to the job
    requeued; then worker node `replacement` joins, the gang runs again and is cancelled."""
    job_id, _ = ray.gang_start(2)
    name = ray.job(job_id)["placement"][1]["node"]
    alive = [n for n in cluster.nodes if n.proc.poll() is None]
    victim = next(n for n in alive if f"ray-{n.node_id()[:12]}" == name)
    t0 = time.perf_counter()
    victim.kill_raylet()
    ray.wait(lambda: ray.job(job_id)["requeues"] == 1, timeout=120, interval=0.02)
    took = time.perf_counter() - t0
    cluster.start_worker(replacement)
    ray.wait(lambda: ray.job(job_id)["state"] == "RUNNING", timeout=120)
    ray.cancel(job_id)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--kills", type=int, default=2)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("skipped: needs root (a private network namespace for the Ray cluster, tenant uids)")
        return
    try:
        import ray  # noqa: F401
    except ImportError:
        print("skipped: Ray is not installed (pip install 'gpucloud[ray]')")
        return
    root = Path(tempfile.mkdtemp(prefix="gpucloud-bench-multinode-"))
    try:
        with own_network():
            _bench(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
