"""Where an engine step's time goes: `serve_offline.py --profile`.

The run goes under cProfile on this process's CPU clock, and each part of a step is the
cumulative time of the functions that do it (scheduling, input preparation, matmuls,
attention, sampling, detokenization, outputs); the rest of the forward (norms, rotary,
activations, embedding, residuals) and of the engine's Python are what is left. cProfile
adds about a microsecond per Python call, so it inflates the Python parts a little.
"""

from __future__ import annotations

import cProfile
import inspect
import pstats
import time

from torch import nn

from gpucloud.hal import ops
from gpucloud.models.quant import Int4Linear, Int8Linear
from gpucloud.serve.cpu_linear import PackedLinear
from gpucloud.serve.detokenizer import IncrementalDetokenizer
from gpucloud.serve.engine import LLMEngine
from gpucloud.serve.runner import ModelRunner
from gpucloud.serve.sampler import Sampler
from gpucloud.serve.scheduler import Scheduler

ATTENTION_OPS = ("write_kv_cache", "paged_attention_decode", "paged_attention_prefill",
                 "prefill_attention")  # fmt: skip
FORWARD_PARTS = ("input preparation", "matmuls", "attention")  # inside ModelRunner.run


def _parts() -> dict[str, list]:
    """Each part of a step and the functions whose cumulative time it is."""
    attention = [ops.get(name) for name in ATTENTION_OPS]
    attention += [ops.choose(name, ops.REFERENCE).fn for name in ATTENTION_OPS]
    return {
        "scheduling": [Scheduler.schedule, Scheduler.update],
        "input preparation": [ModelRunner._prepare],
        "matmuls": [
            nn.Linear.forward,
            PackedLinear.forward,
            Int8Linear.forward,
            Int4Linear.forward,
        ],  # fmt: skip
        "attention": attention,
        "sampling": [Sampler.__call__],
        "detokenization": [IncrementalDetokenizer.add, IncrementalDetokenizer.flush],
        "outputs": [LLMEngine._outputs],
    }


def _key(fn) -> tuple[str, int, str]:
    code = inspect.unwrap(fn).__code__  # ModelRunner.run is wrapped by inference_mode
    return code.co_filename, code.co_firstlineno, code.co_name


def profile(run) -> list[tuple[str, float]]:
    """Run `run()` under cProfile; [(part, CPU seconds)], the last row the total."""
    profiler = cProfile.Profile(time.process_time)
    profiler.runcall(run)
    stats = pstats.Stats(profiler).stats  # key -> (calls, primitive calls, self, cumulative, ..)
    cumulative = {key: row[3] for key, row in stats.items()}
    rows = []
    for part, fns in _parts().items():
        keys = {_key(fn) for fn in fns}
        rows.append((part, sum(cumulative.get(k, 0.0) for k in keys)))
    forward = cumulative.get(_key(ModelRunner.run), 0.0)
    total = cumulative.get(_key(LLMEngine.step), 0.0)
    inside = sum(s for p, s in rows if p in FORWARD_PARTS)
    outside = sum(s for p, s in rows if p not in FORWARD_PARTS)
    rows.append(("rest of the forward", forward - inside))
    rows.append(("rest of the engine", total - forward - outside))
    rows.append(("total", total))
    return rows


def print_profile(rows: list[tuple[str, float]], steps: int, threads: int) -> None:
    total = rows[-1][1]
    print(f"where a step's CPU time goes (cProfile, {steps} steps, {threads} threads; "
          f"CPU seconds of all threads)")  # fmt: skip
    print(f"{'part':22s} {'seconds':>8s} {'share':>6s} {'ms/step':>8s}")
    for part, seconds in rows:
        print(f"{part:22s} {seconds:8.2f} {seconds / total:6.1%} {1000 * seconds / steps:8.2f}")
