"""A job that counts to N, one step per tick, checkpointing its step after each one.

Started again after a preemption or a crash, it resumes from $GPUCLOUD_CHECKPOINT_DIR —
the same contract `gpucloud train` keeps with its step-N checkpoint folders.

    python counter.py STEPS [SECONDS_PER_STEP]
"""

import os
import sys
import time
from pathlib import Path

steps = int(sys.argv[1])
tick = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
ckpt = Path(os.environ.get("GPUCLOUD_CHECKPOINT_DIR", ".")) / "step"
step = int(ckpt.read_text()) if ckpt.exists() else 0
print(
    f"attempt {os.environ.get('GPUCLOUD_ATTEMPT')} starts at step {step} "
    f"on devices {os.environ.get('GPUCLOUD_DEVICES')}",
    flush=True,
)
while step < steps:
    time.sleep(tick)
    step += 1
    tmp = ckpt.with_suffix(".tmp")
    tmp.write_text(str(step))
    tmp.replace(ckpt)  # atomic: a kill never leaves a torn checkpoint
print(f"done at step {step}", flush=True)
