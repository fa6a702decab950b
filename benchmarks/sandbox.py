"""The sandbox's start-up cost per workload: `true` run through the sandbox (cgroups made
and removed, bwrap's namespaces and mounts, setpriv to a tenant's uid) against `true` run
as a plain subprocess, alternating, in the same run. Each figure is the whole life of the
workload: start, exit, and (sandboxed) its teardown. Needs root (a tenant's uid).

    python benchmarks/sandbox.py [--runs 200]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from gpucloud.control.sandbox import Identity, Limits, Sandbox, Spec

TENANT = Identity(61599, 61599)


def _plain(log: Path) -> float:
    t = time.perf_counter()
    with log.open("ab") as out:
        subprocess.Popen(["/bin/sh", "-c", "true"], stdout=out, stderr=out).wait()
    return time.perf_counter() - t


def _sandboxed(sandbox: Sandbox, spec: Spec) -> float:
    t = time.perf_counter()
    proc = sandbox.start(spec)
    proc.wait()
    sandbox.finish(spec.name, proc.pid)
    return time.perf_counter() - t


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpucloud-bench-sandbox-") as d:
        home = Path(d)
        home.chmod(0o711)
        area = home / "tenants" / "bench"
        area.mkdir(parents=True)
        spec = Spec(
            name="bench",
            command="true",
            env={},
            cwd=area,
            log_path=home / "bench.log",
            exit_path=home / "bench.exit",
            identity=TENANT,
            writable=(area,),
            hidden=(home,),
            limits=Limits(cpus=1, memory_bytes=1 << 30, pids=64),
        )
        sandbox = Sandbox("gpucloud-bench")
        plain, boxed = [], []
        for _ in range(args.runs):
            plain.append(_plain(home / "plain.log"))
            boxed.append(_sandboxed(sandbox, spec))
        sandbox.close()
    for name, xs in (("plain subprocess", plain), ("sandboxed", boxed)):
        med, p99 = statistics.median(xs) * 1e3, _p(xs, 0.99) * 1e3
        print(f"{name:>17}: median {med:6.2f} ms   p99 {p99:6.2f} ms")
    added = (statistics.median(boxed) - statistics.median(plain)) * 1e3
    print(
        f"sandboxed / plain: median x{statistics.median(boxed) / statistics.median(plain):.1f}"
        f"   p99 x{_p(boxed, 0.99) / _p(plain, 0.99):.1f}"
        f"   added per workload: {added:.1f} ms (target < 50 ms)"
    )


if __name__ == "__main__":
    main()
