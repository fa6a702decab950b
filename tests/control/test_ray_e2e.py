"""The control plane on a real Ray cluster, end to end: `gpucloud server --executor ray`
over a head and two worker nodes with two fake A100s each (tests/control/ray_cluster.py),
driven through the CLI, the REST API and the OpenAI gateway. Run alone with `pytest -m ray`.

One cluster and one server for the module. The tests run in order; the last one kills a
worker node, and a replacement joins.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from gpucloud.control import routing
from gpucloud.control.client import Client
from gpucloud.control.sandbox import Sandbox, scope_for
from gpucloud.train import checkpoint

from .conftest import GPUCLOUD, Server, wait_for, wait_state
from .ray_cluster import RayCluster, own_network, worker_address

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

# A small real run (the tiny preset, 8 sequences of 32 tokens per step, a checkpoint every 4
# steps), long enough for a node to be killed in the middle of it.
STEPS = 40
TRAIN = f"""
[model]
preset = "tiny"
[data]
path = "data"
seq_len = 32
[optim]
global_batch = 8
micro_batch = 2
lr = 3e-3
warmup_steps = 2
max_steps = {STEPS}
[checkpoint]
every = 4
"""
# 4 fake A100s: both workers' 2 each, so the scheduler spans the gang over two nodes.
JOB = "name: {name}\ntrain: run.toml\ngpus: 4\ngpu_type: A100\ncheckpoint_dir: runs/{name}\n"
ENGINE_ARGS = ["--kv-cache-bytes", str(1 << 22), "--log-level", "warning"]
READY_TIMEOUT = 300.0  # seconds a replica or a gang may take to start on a loaded machine


@dataclass
class Plane:
    cluster: RayCluster
    server: Server

    def cli(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        env = {**self.server.env, "GPUCLOUD_API_KEY": self.server.admin_key or ""}
        return subprocess.run(
            [GPUCLOUD, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
        )

    @property
    def api(self) -> Client:
        return self.server.client()

    def submit(self, spec: str, cwd: Path) -> int:
        out = self.cli("job", "submit", spec, "--json", cwd=cwd)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["id"]


@pytest.fixture(scope="module")
def plane(tmp_path_factory) -> Iterator[Plane]:
    home = tmp_path_factory.mktemp("home")
    with own_network():
        # Ray's own health checks, as users have them: a node is declared dead ~15 s or more
        # after it died, long after its workloads noticed.
        cluster = RayCluster(workers=2, gpus=2, gpu_type="A100", quick_death=False)
        server = None
        try:
            cluster.start()
            ray = ("--executor", "ray", "--ray-address", cluster.address, "--node-timeout", "5")
            server = Server(f"sqlite:///{home / 'state.db'}", home, extra=ray).start()
            yield Plane(cluster, server)
        finally:
            if server is not None:
                server.stop()
            cluster.stop()
            Sandbox(scope_for(home)).close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_model_dir) -> Path:
    """What a user submits training jobs from: the train config and its dataset."""
    from gpucloud.models.corpus import stdlib_text
    from gpucloud.train.prepare import prepare

    work = tmp_path_factory.mktemp("work")
    corpus = work.parent / "corpus.txt"
    corpus.write_text(stdlib_text(300_000))
    prepare(tiny_model_dir, corpus, work / "data")
    (work / "run.toml").write_text(TRAIN)
    return work


@pytest.fixture(scope="module")
def one_node(workdir) -> Iterator[subprocess.Popen]:
    """The same run on one node: `gpucloud train run` with 4 ranks here (started in the
    background; its run dir is workdir/one-node once it exited 0)."""
    cmd = [GPUCLOUD, "train", "run", "run.toml", "--run-dir", "one-node", "--nproc-per-node", "4"]
    with (workdir.parent / "one-node.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_two_node_ddp_job_trains_as_on_one_node(plane, workdir, one_node):
    (workdir / "ddp.yaml").write_text(JOB.format(name="ddp"))
    job_id = plane.submit("ddp.yaml", workdir)

    job = wait_state(plane.api, job_id, "RUNNING", "FAILED", timeout=READY_TIMEOUT)
    nodes = {p["node"]: p["devices"] for p in job["placement"]}
    assert sorted(nodes.values()) == [[0, 1], [0, 1]], job  # both workers, both their GPUs
    job = wait_state(plane.api, job_id, "SUCCEEDED", "FAILED", timeout=READY_TIMEOUT)
    assert job["state"] == "SUCCEEDED", _story(plane, job_id)
    logs = plane.cli("job", "logs", str(job_id)).stdout
    assert f"[node 1] step {STEPS}/{STEPS}" in logs and f"[node 0] step {STEPS}/{STEPS}" in logs
    assert one_node.wait(timeout=READY_TIMEOUT) == 0, (workdir.parent / "one-node.log").read_text()
    assert _losses(_run_dir(plane, job_id)) == _losses(workdir / "one-node")


def test_cancel_stops_every_rank_and_frees_every_bundle(plane, tmp_path):
    spec = tmp_path / "sleeper.yaml"
    spec.write_text("name: sleeper\ncommand: echo started; exec sleep 600\ngpus: 4\n")
    job_id = plane.submit(str(spec), tmp_path)
    wait_for(lambda: "[node 1] started" in plane.cli("job", "logs", str(job_id)).stdout, 120)
    (group,) = [g for g in plane.cluster.groups() if g["name"] == f"job-{job_id}"]
    assert group["state"] == "CREATED" and len(set(group["bundles_to_node_id"].values())) == 2

    out = plane.cli("job", "cancel", str(job_id))
    assert out.returncode == 0, out.stderr

    assert wait_state(plane.api, job_id, "CANCELLED", timeout=60)["state"] == "CANCELLED"
    (group,) = [g for g in plane.cluster.groups() if g["name"] == f"job-{job_id}"]
    assert group["state"] == "REMOVED"
    assert _allocated(plane) == 0


def test_two_replicas_span_both_nodes_and_the_gateway_serves_through_both(plane, tiny_model_dir):
    out = plane.cli(
        "deploy", "create", "chat", str(tiny_model_dir), "--replicas", "2",
        "--gpus-per-replica", "2", "--gpu-type", "A100",
        *(f"--engine-arg={a}" for a in ENGINE_ARGS),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    dep = wait_for(
        lambda: (d := plane.api.get("/deployments/chat"))["ready_replicas"] == 2 and d,
        READY_TIMEOUT,
    )
    replicas = dep["replica_list"]
    assert len({r["node"] for r in replicas}) == 2  # one on each worker
    hosts = sorted(httpx.URL(r["url"]).host for r in replicas)
    assert hosts == [worker_address(0), worker_address(1)]  # reached at their node's address

    gateway = openai.OpenAI(
        base_url=plane.server.url + "/v1", api_key=plane.server.admin_key, max_retries=0
    )
    # The gateway sends a prompt to the replica its prefix hashes to: two prompts for each.
    ids = [r["id"] for r in replicas]
    owned = {rid: [] for rid in ids}
    for i in range(64):
        prompt = f"def f{i}"
        key = routing.prefix_key({"prompt": prompt})
        rid = max(ids, key=lambda rid, key=key: routing.weight(key, rid))
        owned[rid].append(prompt)
    for prompt in [p for rid in ids for p in owned[rid][:2]]:
        done = gateway.completions.create(model="chat", prompt=prompt, max_tokens=3)
        assert done.model == "chat" and done.usage.completion_tokens == 3

    served = [_finished(r["url"]) for r in replicas]
    assert served == [2, 2], served  # each its own two prompts
    assert plane.cli("deploy", "delete", "chat").returncode == 0
    wait_for(lambda: _allocated(plane) == 0, 60)


def test_a_dead_node_requeues_the_job_which_resumes_to_the_same_losses(plane, workdir, one_node):
    """Last: it kills a worker node; a replacement joins."""
    (workdir / "resumed.yaml").write_text(JOB.format(name="resumed"))
    job_id = plane.submit("resumed.yaml", workdir)
    job = wait_state(plane.api, job_id, "RUNNING", timeout=READY_TIMEOUT)
    victim_name = job["placement"][1]["node"]
    victim = next(n for n in plane.cluster.nodes if f"ray-{n.node_id()[:12]}" == victim_name)
    run_dir = wait_for(lambda: _run_dir(plane, job_id), READY_TIMEOUT)
    # a committed checkpoint and a step after it: the kill loses some work
    wait_for(lambda: _committed(run_dir) and max(_losses(run_dir), default=0) > 4, READY_TIMEOUT)

    victim.kill_raylet()
    plane.cluster.start_worker(2)  # capacity returns: a new machine

    wait_for(lambda: _node(plane, victim_name)["state"] == "down", 30)
    job = wait_state(plane.api, job_id, "SUCCEEDED", "FAILED", timeout=READY_TIMEOUT)
    assert job["state"] == "SUCCEEDED", _story(plane, job_id)
    assert (job["attempts"], job["requeues"], job["max_retries"]) == (2, 1, 0)
    moves = [(e["from_state"], e["to_state"], e["reason"]) for e in job["events"]]
    assert [m[:2] for m in moves] == [
        (None, "PENDING"), ("PENDING", "RUNNING"), ("RUNNING", "RETRYING"),
        ("RETRYING", "PENDING"), ("PENDING", "RUNNING"), ("RUNNING", "SUCCEEDED"),
    ]  # fmt: skip
    assert victim_name in moves[2][2] and "requeued (no retry used)" in moves[2][2], moves
    assert victim_name not in moves[4][2]  # on the surviving node and the new one
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumes = [r["step"] for r in records if r.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0] % 4 == 0 and resumes[0] >= 4
    assert one_node.wait(timeout=READY_TIMEOUT) == 0
    resumed, reference = _losses(run_dir), _losses(workdir / "one-node")
    assert sorted(resumed) == sorted(reference) == list(range(1, STEPS + 1))
    # Exact up to the first step after the resume (from the checkpoint's weights). Then the
    # new attempt's DDP has rebuilt its gradient buckets, so the four ranks' gradients are
    # summed in another order: equal up to float32 rounding.
    first = resumes[0] + 1
    assert {s: resumed[s] for s in range(1, first + 1)} == {
        s: reference[s] for s in range(1, first + 1)
    }
    for step in range(first + 1, STEPS + 1):
        assert math.isclose(resumed[step], reference[step], rel_tol=1e-6), step


def _run_dir(plane: Plane, job_id: int) -> Path | None:
    """The job's run dir (its checkpoint_dir in the upload of its workdir)."""
    job = plane.api.get(f"/jobs/{job_id}")
    path = job.get("checkpoint_dir")
    return Path(path) if path and Path(path, "metrics.jsonl").exists() else None


def _losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a step logged twice (replayed after a resume) keeps its last value."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _committed(run_dir: Path) -> list:
    return list(checkpoint.committed(run_dir / "checkpoints"))


def _finished(url: str) -> int:
    """How many completions the replica at `url` finished (its /metrics)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    found = re.findall(r"^gpucloud_serve_request_success_total\{[^}]*\} (\S+)$", text, re.M)
    return int(sum(float(v) for v in found))


def _story(plane: Plane, job_id: int) -> str:
    """The job, its events and its logs: what a failed assertion shows."""
    story = [plane.cli("job", what, str(job_id)).stdout for what in ("get", "logs")]
    return "\n".join(story)


def _node(plane: Plane, name: str) -> dict:
    return next(n for n in plane.api.get("/nodes") if n["name"] == name)


def _allocated(plane: Plane) -> int:
    return sum(n["gpus_allocated"] for n in plane.api.get("/nodes"))
