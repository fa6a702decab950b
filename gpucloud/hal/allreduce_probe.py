"""A 2-process all-reduce through the backend's collective library, and its bandwidth.

`measure()` starts two copies of this module (`python -m gpucloud.hal.allreduce_probe`)
that meet through a file store in a temporary directory (no port to pick or to collide),
all-reduce a buffer, check the sum, time a few more rounds and print one JSON line each.
Separate processes are what training uses, so a firewall, a broken NCCL/HCCL install or a
missing shared-memory mount fails here the way it would fail a job.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

WORLD = 2


@dataclass(frozen=True, slots=True)
class AllReduceResult:
    dist_backend: str
    device: str
    nbytes: int
    seconds: float  # per all-reduce, the slower rank's mean
    bus_bytes_per_s: float  # nccl-tests' bus bandwidth: 2 (n-1)/n · bytes / time


def measure(
    backend_name: str, nbytes: int = 16 << 20, iters: int = 5, timeout: float = 120.0
) -> AllReduceResult:
    """Run the probe on `backend_name` (one device per rank; cpu: gloo on the host).

    Raises RuntimeError with the ranks' own error output when the all-reduce fails, gives a
    wrong sum or does not finish within `timeout` seconds.
    """
    with tempfile.TemporaryDirectory(prefix="gpucloud-doctor-") as tmp:
        store = Path(tmp) / "store"
        procs = [_start(rank, backend_name, store, nbytes, iters) for rank in range(WORLD)]
        outputs = [_wait(p, timeout) for p in procs]
    results = [_result(*output) for output in outputs]
    seconds = max(r["seconds"] for r in results)
    return AllReduceResult(
        results[0]["dist_backend"],
        results[0]["device"],
        nbytes,
        seconds,
        2 * (WORLD - 1) / WORLD * nbytes / seconds,
    )


def _start(rank: int, backend: str, store: Path, nbytes: int, iters: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "gpucloud.hal.allreduce_probe", "--rank", str(rank),
            "--backend", backend, "--store", str(store), "--nbytes", str(nbytes),
            "--iters", str(iters)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return 1, "", f"the all-reduce did not finish within {timeout:.0f} s"
    return proc.returncode, out, err


def _result(code: int, out: str, err: str) -> dict:
    """A rank's JSON line; RuntimeError with its error when it failed."""
    lines = out.strip().splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    if code == 0 and "seconds" in result:
        return result
    err_lines = [line for line in err.strip().splitlines() if line.strip()]
    raise RuntimeError(result.get("error") or (err_lines or ["a rank died silently"])[-1])


def _rank_main(rank: int, backend_name: str, store: str, nbytes: int, iters: int) -> dict:
    import torch
    import torch.distributed as dist

    from gpucloud.hal import device as hal_device

    backend = hal_device.get_backend(backend_name)
    hal_device.set_device(rank, backend)
    dev = hal_device.device(rank, backend)
    dist.init_process_group(backend.dist_backend, init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))  # fmt: skip
    try:
        x = torch.full((nbytes // 4,), float(rank + 1), device=dev)
        dist.all_reduce(x)  # also the warm-up: connections are made on first use
        expected = WORLD * (WORLD + 1) / 2
        if not bool((x == expected).all()):
            raise RuntimeError(f"all-reduce gave a wrong sum (expected {expected} everywhere)")
        dist.barrier()
        hal_device.synchronize(backend)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        hal_device.synchronize(backend)
        seconds = (time.perf_counter() - start) / iters
    finally:
        dist.destroy_process_group()
    return {"dist_backend": backend.dist_backend, "device": str(dev), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name, kind in (("rank", int), ("backend", str), ("store", str), ("nbytes", int),
                       ("iters", int)):  # fmt: skip
        parser.add_argument(f"--{name}", type=kind, required=True)
    args = parser.parse_args()
    try:
        result = _rank_main(args.rank, args.backend, args.store, args.nbytes, args.iters)
    except Exception as e:  # noqa: BLE001 - any failure is the finding, reported in one line
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(json.dumps({"error": f"rank {args.rank}: {type(e).__name__}: {first}"}), flush=True)
        sys.exit(1)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
