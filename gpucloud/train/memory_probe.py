"""Ground truth for the memory model: run real training steps of our decoder on this machine
and report the peak of live tensor bytes, read from the torch profiler's allocation events.

It lives in `train` (which may import torch and models) so the planner stays pure. Tests
and `benchmarks/planner_accuracy.py` use it to check the planner's memory estimate against
reality.

The step measured is the one the training runtime runs: forward of `LlamaForCausalLM`
(optionally with every decoder layer under non-reentrant `torch.utils.checkpoint`),
the runtime's `loss_fn` (fp32 cross-entropy of logits no one else holds), backward, `AdamW.step()`,
`zero_grad(set_to_none=True)`. The second step is profiled, so Adam's states exist.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from gpucloud.errors import UserError
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.spec import ModelSpec
from gpucloud.train.parallel import loss_fn

# fp32; pure bf16 (weights, grads, Adam states, activations); fp32 weights under
# torch.autocast(bf16), as the training runtime runs DDP in mixed precision.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "autocast-bf16": torch.float32}


@dataclass(frozen=True)
class MeasuredStep:
    """Bytes of one training step. `peak_bytes` counts every live tensor, model states too."""

    peak_bytes: int
    params_bytes: int
    optimizer_bytes: int
    after_forward_bytes: int  # live right after the loss: states + saved activations + loss
    phase_peak_bytes: dict[str, int]  # forward, backward, optimizer: the peak within each

    @property
    def states_bytes(self) -> int:
        return self.params_bytes + self.optimizer_bytes


class _Checkpointed(nn.Module):
    """A decoder layer whose activations are recomputed in backward (non-reentrant)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return checkpoint(self.layer, *args, use_reentrant=False)


def measure_training_step(
    spec: ModelSpec,
    micro_batch: int,
    seq_len: int,
    recompute: str = "none",
    dtype: str = "fp32",
    seed: int = 0,
) -> MeasuredStep:
    """Run two training steps on CPU and return the second one's memory figures.

    `dtype`: fp32, bf16 (pure) or autocast-bf16 (fp32 weights, bf16 autocast).
    Raises UserError for a recompute mode other than none/full or an unknown dtype.
    """
    if recompute not in ("none", "full"):
        raise UserError(f"measured recompute must be none or full, not {recompute!r}")
    if dtype not in DTYPES:
        raise UserError(f"measured dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(spec)
    model.init_weights(seed)
    model.to(DTYPES[dtype])
    if recompute == "full":
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = _Checkpointed(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (micro_batch, seq_len + 1), generator=gen)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast-bf16")

    def forward_backward(mark) -> None:
        # As the training runtime: the logits go straight into the loss, so they die in
        # forward (log-softmax keeps only its output).
        with autocast:
            loss = loss_fn(model(inputs), targets)
            mark(1)
            loss.backward()

    def step(mark=lambda phase: None) -> None:
        forward_backward(mark)
        mark(2)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    params = _nbytes(model.parameters())
    optimizer = _nbytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    baseline = params + optimizer + _nbytes([inputs, targets, ids])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(mark)
    phases = _phase_peaks(prof)
    return MeasuredStep(
        peak_bytes=baseline + max(phases.values()),
        params_bytes=params,
        optimizer_bytes=optimizer,
        after_forward_bytes=baseline + phases["after_forward"],
        phase_peak_bytes={k: baseline + v for k, v in phases.items() if k != "after_forward"},
    )


# An allocation of a recognisable size, made and freed at once, marks the end of a phase in
# the allocation stream: marker k has _MARKER_BYTES + k bytes.
_MARKER_BYTES = 7 * 1024 * 1024 + 13
_PHASES = ("forward", "backward", "optimizer")


def mark(phase: int) -> None:
    """Leave marker `phase` (1 or 2) in the allocation stream of a running profile."""
    torch.empty(_MARKER_BYTES + phase, dtype=torch.uint8)


def marker_phase(size: int) -> int | None:
    """The phase of a marker's allocation (size > 0) or free (size < 0), else None."""
    phase = abs(size) - _MARKER_BYTES
    return phase if phase in (1, 2) else None


def allocation_sizes(prof: profile, witnessed: bool = False) -> list[int]:
    """Sizes of the profile's CPU allocations (> 0) and frees (< 0), in time order.

    The profiler records only the frees made on the thread that profiles: it misses those
    of gloo's worker threads, which drop a finished collective's input and output when the
    main thread is done with them first (a race, so a different rank each run: under tensor
    parallel the LM head's local logits and their gathered copy, 6.3 MB on `tiny`). Such a
    free shows when the block's address is allocated again with none recorded; with
    `witnessed`, the profile ends with a step after its last marker that uses every block
    still alive, so a block neither freed nor used there was freed unseen too. Either way
    the block went when the main thread was done with it: its free is put at the end of the
    last op that read it (ops' inputs are recorded under `record_shapes`), else where it is
    known to be gone."""
    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    events = sorted(
        (n.start_time_ns, n.extra_fields.ptr, n.extra_fields.alloc_size)
        for n in nodes
        if n.tag == _EventType.Allocation and str(n.extra_fields.device) == "cpu"
    )
    uses: dict[int, list[int]] = {}  # storage address: end times of the ops that read it
    for n in nodes:
        if n.tag == _EventType.TorchOp:
            for ptr in _input_storages(n.extra_fields.inputs):
                uses.setdefault(ptr, []).append(n.end_time_ns)
    last_marker = max((t for t, _, size in events if marker_phase(size)), default=None)
    live: dict[int, tuple[int, int]] = {}  # address: (allocated at, size)
    timed = []
    for t, ptr, size in events:
        if size > 0 and ptr in live:
            timed.append(_unseen_free(*live[ptr], ptr, t, uses))
        if size > 0:
            live[ptr] = (t, size)
        else:
            live.pop(ptr, None)
        timed.append((t, size))
    if witnessed and last_marker is not None:
        for ptr, (t, size) in live.items():
            if t < last_marker and max(uses.get(ptr, [t])) < last_marker:
                timed.append(_unseen_free(t, size, ptr, last_marker, uses))
    return [size for _, size in sorted(timed, key=lambda e: e[0])]


def _unseen_free(allocated: int, size: int, ptr: int, gone: int, uses) -> tuple[int, int]:
    """(time, -size): the free of a block known to be gone at `gone`, at the end of the
    last op that read it before then."""
    read = [end for end in uses.get(ptr, ()) if allocated < end < gone]
    return (max(read, default=gone), -size)


def _input_storages(inputs) -> Iterator[int]:
    for item in inputs:
        if isinstance(item, list):
            yield from _input_storages(item)
        elif getattr(item, "storage_data_ptr", None):
            yield item.storage_data_ptr


def _phase_peaks(prof: profile) -> dict[str, int]:
    """Peak of bytes allocated since the profile began, per phase, from allocation events."""
    running, phase = 0, 0
    peaks = dict.fromkeys(_PHASES, 0)
    after_forward = 0
    for size in allocation_sizes(prof):
        marker = marker_phase(size)
        if marker is not None:
            if size > 0:
                phase = marker
                after_forward = after_forward or running
            continue
        running += size
        peaks[_PHASES[phase]] = max(peaks[_PHASES[phase]], running)
    return {**peaks, "after_forward": after_forward}


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def _nbytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
