"""Numeric diff: run one input through two configurations of a model (device, dtype, a
second checkpoint of the same architecture, or the reference ops in place of the backend's
own) and compare every module's output.

Forward hooks record each module's output as it completes, so a child (`...mlp.down_proj`)
comes before its parent (`...mlp`) and the first module past the tolerance is the most
specific place where the two runs part. Run A's outputs are kept on the CPU in float32;
run B is compared module by module as it executes, so only one model is loaded at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from gpucloud.errors import ConfigError, UserError, unknown_name
from gpucloud.hal import device as hal_device
from gpucloud.hal import ops
from gpucloud.models.loader import dtype_name, load_model, parse_dtype
from gpucloud.models.spec import ModelSpec

# Default tolerance on the relative error, by the least precise dtype of the two runs:
# about the rounding a residual stream accumulates over a few dozen layers at that precision.
DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
_PRECISION = [torch.float32, torch.float16, torch.bfloat16]  # most to least precise


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Where and at what precision one side of the diff runs, and whose ops it uses: the
    backend's own choice (None) or `ops.REFERENCE` for every op."""

    backend: str
    dtype: torch.dtype
    ops: str | None = None

    @classmethod
    def parse(cls, text: str) -> RunConfig:
        """`BACKEND:DTYPE` (e.g. `cpu:bfloat16`, `cuda:float16`). Raises UserError."""
        name, _, dtype = text.partition(":")
        if not dtype:
            raise UserError(f"bad configuration {text!r}: use BACKEND:DTYPE, e.g. cpu:float32")
        if name not in hal_device.BACKENDS:
            raise unknown_name("backend", name, hal_device.BACKENDS)
        if name not in hal_device.available():
            raise UserError(
                f"backend {name!r} is not available here; available: "
                f"{', '.join(hal_device.available())}"
            )
        return cls(name, parse_dtype(dtype))

    def __str__(self) -> str:
        text = f"{self.backend}:{dtype_name(self.dtype)}"
        return text if self.ops is None else f"{text} ({self.ops} ops)"


@dataclass(frozen=True, slots=True)
class ModuleDiff:
    name: str
    max_abs: float | None  # None: the output is missing or has another shape in run B
    rel: float | None  # ‖a − b‖ / ‖a‖ over the module's output tensors
    note: str | None = None


@dataclass(frozen=True, slots=True)
class DiffReport:
    a: str
    b: str
    tolerance: float
    modules: list[ModuleDiff]
    first_divergent: str | None

    def to_json(self) -> dict:
        return {
            "a": self.a,
            "b": self.b,
            "tolerance": self.tolerance,
            "first_divergent": self.first_divergent,
            "modules": [
                {"name": m.name, "max_abs": m.max_abs, "rel": m.rel}
                | ({"note": m.note} if m.note else {})
                for m in self.modules
            ],
        }


def default_tolerance(a: RunConfig, b: RunConfig) -> float:
    """The tolerance of the less precise of the two dtypes."""
    worst = max(_PRECISION.index(a.dtype), _PRECISION.index(b.dtype))
    return DEFAULT_TOLERANCE[_PRECISION[worst]]


def check_same_architecture(a_dir: Path, b_dir: Path) -> None:
    """Raise ConfigError naming the first config field in which the two models differ."""
    a, b = ModelSpec.from_dir(a_dir), ModelSpec.from_dir(b_dir)
    for f in fields(ModelSpec):
        if f.name != "name" and f.compare and getattr(a, f.name) != getattr(b, f.name):
            raise ConfigError(
                f"{a_dir} and {b_dir} are different architectures: {f.name} is "
                f"{getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
            )


def sample_tokens(spec: ModelSpec, seed: int, batch: int = 2, length: int = 16) -> torch.Tensor:
    """A fixed, seeded batch of token ids: the same input on every run with the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (batch, length), generator=gen)


def prompt_tokens(model_dir: Path, prompt: str) -> torch.Tensor:
    """The prompt tokenized with the model dir's tokenizer, as a batch of one."""
    from gpucloud.models.tokenizer import load_tokenizer

    if not prompt:
        raise UserError("--prompt is empty: give some text")
    return torch.tensor([load_tokenizer(model_dir).encode(prompt)])


def numeric_diff(
    a_dir: Path,
    b_dir: Path,
    a: RunConfig,
    b: RunConfig,
    tokens: torch.Tensor,
    tolerance: float | None = None,
) -> DiffReport:
    """Run `tokens` through model `a_dir` under `a` and `b_dir` under `b`; compare modules."""
    if a_dir != b_dir:
        check_same_architecture(a_dir, b_dir)
    tol = default_tolerance(a, b) if tolerance is None else tolerance
    reference: dict[str, list[torch.Tensor]] = {}
    order: list[str] = []

    def keep(name: str, out: list[torch.Tensor]) -> None:
        order.append(name)
        reference[name] = out

    _run(a_dir, a, tokens, keep)
    seen: dict[str, ModuleDiff] = {}

    def compare(name: str, out: list[torch.Tensor]) -> None:
        seen[name] = _compare(name, reference.get(name), out)

    _run(b_dir, b, tokens, compare)
    modules = [seen.get(name) or ModuleDiff(name, None, None, "not run in b") for name in order]
    first = next((m.name for m in modules if m.rel is None or m.rel > tol), None)
    return DiffReport(str(a), str(b), tol, modules, first)


def _run(model_dir: Path, config: RunConfig, tokens: torch.Tensor, record) -> None:
    backend = hal_device.get_backend(config.backend)
    dev = hal_device.device(0, backend)
    with ops.using(config.ops or config.backend):  # the ops of this run, not of the machine
        model = load_model(model_dir, config.dtype, dev)
    with torch.inference_mode(), _hooks(model, record):
        model(tokens.to(dev))
    del model


@contextmanager
def _hooks(model: nn.Module, record) -> Iterator[None]:
    """Call `record(name, outputs)` as each named module finishes, with its tensors on the
    CPU in float32; a module called twice is recorded as `name#2`."""
    calls: dict[str, int] = {}

    def hook_for(name: str):
        def hook(_module, _inputs, output):
            calls[name] = calls.get(name, 0) + 1
            key = name if calls[name] == 1 else f"{name}#{calls[name]}"
            record(key, [t.detach().float().cpu() for t in _tensors(output)])

        return hook

    handles = [m.register_forward_hook(hook_for(n)) for n, m in model.named_modules() if n]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, list | tuple):
        return [t for item in output for t in _tensors(item)]
    return []


def _compare(name: str, a: list[torch.Tensor] | None, b: list[torch.Tensor]) -> ModuleDiff:
    if a is None:
        return ModuleDiff(name, None, None, "not run in a")
    if [t.shape for t in a] != [t.shape for t in b]:
        return ModuleDiff(name, None, None, "outputs of different shapes")
    for side, outs in (("a", a), ("b", b)):
        if not all(bool(t.isfinite().all()) for t in outs):
            return ModuleDiff(name, None, None, f"NaN or Inf in {side}")
    pairs = list(zip(a, b, strict=True))
    max_abs = max((float((x - y).abs().max()) for x, y in pairs if x.numel()), default=0.0)
    diff = sum(float((x - y).pow(2).sum()) for x, y in pairs) ** 0.5
    norm = sum(float(x.pow(2).sum()) for x in a) ** 0.5
    if not norm:  # a is all zeros: no scale to be relative to
        return ModuleDiff(name, max_abs, None, "all zeros in a") if diff else ModuleDiff(name, 0, 0)
    return ModuleDiff(name, max_abs, diff / norm)
