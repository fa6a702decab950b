"""Model loading: `gpucloud.models.loader.load_model` against transformers' `from_pretrained`,
on the same random-weight directory (the `small` preset by default, 176 MB at fp32).

Each loader runs in a fresh process (imports untimed), so one-time costs inside the first
load (lazy imports, meta kernels) show in "first load"; "best of 5" is the steady state.
"Resident" is how much the process's resident memory grew over the first load: mapped
weights count only once read, so it shows whether a loader copies the file.

    python benchmarks/model_load.py [--preset small] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from gpucloud.models.loader import init_model_dir

CHILD = r"""
import json, sys, time
from pathlib import Path
loader, model_dir = sys.argv[1], sys.argv[2]
if loader == "gpucloud":
    from gpucloud.models.loader import load_model as load
else:
    from transformers import AutoModelForCausalLM
    load = AutoModelForCausalLM.from_pretrained
def resident():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096
times = []
before = resident()
for i in range(5):
    start = time.perf_counter()
    model = load(model_dir)
    times.append(time.perf_counter() - start)
    if i == 0:
        grown = resident() - before
    del model
print(json.dumps({"first": times[0], "best": min(times), "resident": grown}))
"""


def measure(loader: str, model_dir: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, loader, str(model_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model_dir(args.preset, Path(tmp) / args.preset, dtype=args.dtype)
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        ours, theirs = measure("gpucloud", model_dir), measure("transformers", model_dir)
    print(f"{args.preset} at {args.dtype}: {size / 2**20:.1f} MiB of safetensors")
    print(f"{'':14}{'first load':>12}{'best of 5':>12}{'resident':>12}")
    for name, r in (("gpucloud", ours), ("transformers", theirs)):
        mib = r["resident"] / 2**20
        print(f"{name:14}{r['first'] * 1e3:>10.1f}ms{r['best'] * 1e3:>10.1f}ms{mib:>9.1f}MiB")
    print(
        f"speedup: first load {theirs['first'] / ours['first']:.1f}x, "
        f"best of 5 {theirs['best'] / ours['best']:.1f}x"
    )


if __name__ == "__main__":
    main()
