"""The run config: one TOML file parsed into nested pydantic models.

Every section forbids unknown keys, so a typo fails with the key's name. Checks that need
only the file live here (`RunConfig` validators); checks that need the world size, the
backend or the data on disk live in `preflight`, which the launcher runs before any process
starts.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpucloud import storage
from gpucloud.errors import ConfigError
from gpucloud.storage import Location


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    preset: str | None = None
    """A preset name from `gpucloud model list` (random init)."""
    path: str | None = None
    """An HF-format model directory to continue training from."""
    seed: int = 0
    """Seed of the random init (presets only)."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.preset is None) == (self.path is None):
            raise ValueError("set exactly one of model.preset and model.path")
        return self


class DataConfig(_Section):
    path: str
    """A directory written by `gpucloud data prepare`."""
    seq_len: int = Field(256, gt=0)
    seed: int = 0
    """Seed of the sample order; the order is a pure function of (seed, step)."""


class OptimConfig(_Section):
    global_batch: int | None = Field(None, gt=0)
    """Sequences per optimizer step across all data-parallel ranks."""
    global_batch_tokens: int | None = Field(None, gt=0)
    """Or: tokens per optimizer step (must be a multiple of data.seq_len)."""
    micro_batch: int = Field(1, gt=0)
    """Sequences per forward/backward on one rank."""
    lr: float = Field(3e-4, gt=0)
    min_lr: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    max_steps: int = Field(gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0)
    """Max global grad norm; 0 disables clipping (the norm is still measured)."""

    @model_validator(mode="after")
    def _one_batch(self) -> OptimConfig:
        if (self.global_batch is None) == (self.global_batch_tokens is None):
            raise ValueError("set exactly one of optim.global_batch and optim.global_batch_tokens")
        return self


class ParallelConfig(_Section):
    """How the ranks hold the model: one device mesh (pp, dp, tp), tp innermost, spelled
    `strategy` + `pipeline_stages` + `tp`, or by its degrees `dp_shard`, `tp`, `pp`. The
    data-parallel degree is always the rest: processes / (tp × pp); with pipeline stages,
    data-parallel replicas average their gradients (FSDP2 is not combined with stages)."""

    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How data-parallel ranks hold the model: whole (ddp) or sharded by FSDP2 (fsdp)."""
    dp_shard: int | None = Field(None, ge=1)
    """The mesh spelling of strategy = 'fsdp': FSDP2 shards over this many ranks, which must
    be processes / (tp × pp). Setting it implies strategy = 'fsdp'."""
    tp: int = Field(1, ge=1)
    """Tensor parallel: attention heads and MLP columns (and the vocabulary) split over this
    many neighbouring ranks, norms sequence-parallel; composes with fsdp (2D) and with
    pipeline stages."""
    reshard_after_forward: bool = True
    """fsdp: free gathered parameters after forward (ZeRO-3) or keep them (ZeRO-2)."""
    pipeline_stages: int = Field(1, ge=1)
    """>1: split the decoder layers into this many stages (also spelled `pp`); more
    processes than stages × tp run data-parallel replicas of the pipeline."""
    pipeline_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (torch.utils.checkpoint, non-reentrant)."""
    offload_optimizer: bool = False
    """fsdp: keep the parameter and gradient shards and the optimizer states in host memory
    and step the optimizer there (FSDP2's CPUOffloadPolicy): for memory, not speed."""

    @model_validator(mode="after")
    def _offload_with_fsdp(self) -> ParallelConfig:
        if self.offload_optimizer and self.strategy != "fsdp":
            raise ValueError("offload_optimizer shards states with FSDP2: set "
                             "parallel.strategy = 'fsdp'")  # fmt: skip
        return self

    @model_validator(mode="before")
    @classmethod
    def _mesh_spelling(cls, data: Any) -> Any:
        """`pp` is `pipeline_stages`; `dp_shard` means FSDP2 unless the strategy says otherwise."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "pp" in data:
            pp = data.pop("pp")
            if data.setdefault("pipeline_stages", pp) != pp:
                raise ValueError("parallel.pp and parallel.pipeline_stages are one setting: "
                                 "give one of them")  # fmt: skip
        if data.get("dp_shard") is not None:
            data.setdefault("strategy", "fsdp")
            if data["strategy"] != "fsdp" and data["dp_shard"] != 1:
                raise ValueError("parallel.dp_shard shards parameters with FSDP2: set "
                                 "parallel.strategy = 'fsdp' or drop dp_shard")  # fmt: skip
        return data


class PrecisionConfig(_Section):
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype; master weights and optimizer state stay fp32. fp16 uses loss scaling."""


class CheckpointConfig(_Section):
    dir: str | None = None
    """Default: RUN_DIR/checkpoints. A path (a shared filesystem's too) or a URL such as
    s3://bucket/run1/ckpt, so a run moved to another machine resumes from the same steps."""
    every: int = Field(100, gt=0)
    """Save after every N optimizer steps (and at the last step)."""
    async_save: bool = Field(True, alias="async")
    """Write in a background thread; the step waits only for the staging copy."""
    keep: int = Field(3, ge=1)
    """Keep the newest K committed checkpoints."""


class HealthConfig(_Section):
    on_nan: Literal["skip", "rollback", "stop"] = "skip"
    """A NaN/inf loss or grad norm on any rank."""
    on_spike: Literal["ignore", "skip", "rollback", "stop"] = "ignore"
    spike_factor: float = Field(10.0, gt=1)
    """A spike is a grad norm above factor × the mean of the last `spike_window` steps."""
    spike_window: int = Field(20, ge=2)
    max_rollbacks: int = Field(3, ge=0)
    """Stop when more rollbacks than this were needed."""
    straggler_factor: float = Field(2.0, gt=1)
    """A straggler is a rank whose own work in a step (reading its batches and its forward
    passes) takes longer than factor × the median of its peers' (and 50 ms more)..."""
    straggler_steps: int = Field(3, ge=1)
    """...for this many consecutive steps. It is reported (metrics, log), not removed."""
    hang_timeout_s: float = Field(600.0, gt=0)
    """A step not finished after this long (a rank stopped, a collective that never
    completes) makes every rank report the ranks that fell behind and exit; the launcher
    then exits 4, retryable: a new attempt resumes from the last checkpoint."""


class LoggingConfig(_Section):
    every: int = Field(1, gt=0)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus text on this port from rank 0 (0 = any free port)."""
    accelerator: str | None = None
    """Catalog name whose bf16 peak is the MFU denominator, e.g. H100-SXM."""
    peak_tflops: float | None = Field(None, gt=0)
    """Or: the per-device peak in TFLOP/s (e.g. for a CPU)."""
    profile_steps: str | None = Field(None, pattern=r"^[1-9][0-9]*:[1-9][0-9]*$")
    """A:B: record steps A to B (1-based, inclusive) with the torch profiler on rank 0 into
    RUN_DIR/profile-steps-A-B.json (Chrome/Perfetto trace; `gpucloud doctor --trace`)."""

    @model_validator(mode="after")
    def _profile_range(self) -> LoggingConfig:
        if self.profile_steps is not None and self.profile_range[0] > self.profile_range[1]:
            raise ValueError(f"logging.profile_steps {self.profile_steps}: A must be <= B")
        return self

    @property
    def profile_range(self) -> tuple[int, int] | None:
        if self.profile_steps is None:
            return None
        first, last = self.profile_steps.split(":")
        return int(first), int(last)


class EvalConfig(_Section):
    every: int = Field(0, ge=0)
    """Log `val_loss` on the data's `val` split after every N optimizer steps (and at the
    last step); 0: never."""
    batches: int = Field(4, gt=0)
    """Micro-batches of the val split each data-parallel rank scores: the same windows at
    every evaluation, so the curve compares like with like."""


class RecipeConfig(_Section):
    """What a step optimizes: next-token loss on prepared text, or a fine-tuning recipe on
    a JSONL file (`data.path`) with the tokenizer and chat template of `model.path`."""

    kind: Literal["pretrain", "sft", "dpo"] = "pretrain"
    """sft: chat-formatted `{"messages": [...]}` lines, loss on assistant tokens only.
    dpo: `{"prompt", "chosen", "rejected"}` preference pairs against the frozen start model."""
    packing: bool = True
    """sft: put several conversations in one sequence, each attending only to itself."""
    beta: float = Field(0.1, gt=0)
    """dpo: how far the policy may move from the reference (higher: closer)."""


class LoraConfig(_Section):
    """Train LoRA adapters on a frozen base (saved in PEFT's format by `train export`)."""

    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    target_modules: list[
        Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ] = Field(["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    base_quantization: Literal["int8", "int4"] | None = None
    """QLoRA: the frozen base weight-only quantized; the adapters train in fp32."""


class MoeConfig(_Section):
    """Mixture-of-experts training (a Mixtral-style model): routing's extra terms."""

    aux_loss_coef: float = Field(0.01, ge=0)
    """Weight of the load-balancing loss (the mean over MoE layers) added to the loss."""
    capacity_factor: float | None = Field(None, gt=0)
    """Each expert takes at most factor × its even share of a micro-batch's assignments;
    the overflow is dropped (its token keeps the residual path). None: no limit."""


class LaunchConfig(_Section):
    max_restarts: int = Field(3, ge=0)
    """torchrun restarts the whole group this many times after a worker dies."""


class FaultConfig(_Section):
    """Fault injection for drills and tests (train/faults.py), on the first attempt only."""

    kill_at_step: int | None = Field(None, gt=0)
    """SIGKILL rank `kill_rank` right after this step."""
    kill_rank: int = Field(0, ge=0)
    nan_at_step: int | None = Field(None, gt=0)
    """Make rank 0's loss NaN at this step."""
    slow_rank: int | None = Field(None, ge=0)
    """Make this rank a straggler: it sleeps `slow_seconds` in each step's forward passes."""
    slow_seconds: float = Field(0.5, gt=0)
    hang_at_step: int | None = Field(None, gt=0)
    """Rank `hang_rank` stops (sleeps) before this step, as a hung rank does."""
    hang_rank: int = Field(0, ge=0)


class RunConfig(_Section):
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    health: HealthConfig = HealthConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()
    recipe: RecipeConfig = RecipeConfig()
    lora: LoraConfig | None = None
    """Present: train adapters only. Absent: every weight trains."""
    moe: MoeConfig | None = None
    """Mixture-of-experts models only; absent: the defaults above."""
    launch: LaunchConfig = LaunchConfig()
    fault: FaultConfig = FaultConfig()

    @model_validator(mode="after")
    def _batch_in_sequences(self) -> RunConfig:
        tokens = self.optim.global_batch_tokens
        if tokens is not None and tokens % self.data.seq_len:
            raise ValueError(
                f"optim.global_batch_tokens ({tokens}) must be a multiple of "
                f"data.seq_len ({self.data.seq_len})"
            )
        return self

    @model_validator(mode="after")
    def _eval_on_one_stage(self) -> RunConfig:
        if self.eval.every and self.parallel.pipeline_stages > 1:
            raise ValueError(
                "eval.every needs the whole model on each rank: set eval.every = 0 with "
                "parallel.pipeline_stages > 1"
            )
        return self

    @model_validator(mode="after")
    def _sequence_splits(self) -> RunConfig:
        tp, seq_len = self.parallel.tp, self.data.seq_len
        if seq_len % tp:
            raise ValueError(f"parallel.tp ({tp}) must divide data.seq_len ({seq_len}): "
                             "norms run sequence-parallel, on a slice each")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _fine_tuning_fits(self) -> RunConfig:
        tuned = self.recipe.kind != "pretrain"
        if tuned and self.model.path is None:
            raise ValueError(f"recipe.kind = '{self.recipe.kind}' fine-tunes a model: set "
                             "model.path to an HF-format model directory")  # fmt: skip
        if tuned and self.parallel.pipeline_stages > 1:
            raise ValueError("fine-tuning recipes run with ddp or fsdp: set "
                             "parallel.pipeline_stages = 1")  # fmt: skip
        if tuned and self.eval.every:
            raise ValueError("eval.every reads a prepared dataset's val split: set eval.every = 0 "
                             "with recipe.kind = 'sft' or 'dpo'")  # fmt: skip
        if self.lora is not None and self.model.path is None:
            raise ValueError("[lora] adapts a trained model: set model.path")
        if tuned and self.parallel.tp > 1:
            raise ValueError("fine-tuning recipes run without tensor parallelism: set "
                             "parallel.tp = 1")  # fmt: skip
        par = self.parallel
        plain_ddp = par.strategy == "ddp" and par.pipeline_stages == 1 and par.tp == 1
        if self.lora is not None and not plain_ddp:
            raise ValueError("[lora] trains with parallel.strategy = 'ddp' and no pipeline "
                             "stages (its weights are small)")  # fmt: skip
        return self

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        if self.optim.global_batch is not None:
            return self.optim.global_batch
        return self.optim.global_batch_tokens // self.data.seq_len

    def checkpoint_dir(self, run_dir: Path) -> Location:
        if self.checkpoint.dir:
            return storage.location(self.checkpoint.dir)
        return run_dir / "checkpoints"

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


def parse(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a config dict. ConfigError names the offending key and what is allowed."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            msg = "unknown key"
        raise ConfigError(f"{source}: {where}: {msg}") from None


def load(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML run config and apply `key=value` overrides (value in TOML syntax)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read run config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    for item in overrides:
        apply_override(data, item)
    return parse(data, str(path))


def apply_override(data: dict[str, Any], item: str) -> None:
    """`optim.lr=1e-3` → data["optim"]["lr"] = 1e-3. Values are TOML; bare words are strings."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: use section.key=value, e.g. optim.max_steps=100")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    *parents, leaf = key.strip().split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part} is not a section")
    node[leaf] = value


def save(cfg: RunConfig, path: Path) -> None:
    path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


def load_resolved(path: Path) -> RunConfig:
    """The JSON copy the launcher writes into the run directory for the workers."""
    return parse(json.loads(path.read_text()), str(path))


class Layout(BaseModel):
    """How a config maps onto `world_size` ranks: data-parallel size, stages, accumulation."""

    model_config = ConfigDict(frozen=True)

    world_size: int
    dp: int
    pp: int
    tp: int = 1
    micro_batch: int
    accum: int
    """Micro-batches per rank per optimizer step (pipeline: microbatches per schedule run)."""

    @property
    def sequences_per_step(self) -> int:
        return self.dp * self.micro_batch * self.accum

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel replica `rank` belongs to (mesh order pp, dp, tp; tp innermost):
        the tp ranks of a replica read the same samples."""
        return rank // self.tp % self.dp

    @property
    def loss_ranks(self) -> int:
        """Ranks holding a step's loss: the sum of their losses / this is the mean."""
        return self.dp * self.tp


def layout(cfg: RunConfig, world_size: int) -> Layout:
    """Derive the layout; ConfigError says what to change when the numbers do not divide."""
    par = cfg.parallel
    pp, tp = par.pipeline_stages, par.tp
    if world_size % pp:
        raise ConfigError(
            f"parallel.pipeline_stages ({pp}) must divide the number of processes ({world_size})"
        )
    if world_size % (tp * pp):
        raise ConfigError(f"parallel.tp × pipeline stages ({tp} × {pp}) must divide the number "
                          f"of processes ({world_size})")  # fmt: skip
    dp = world_size // (tp * pp)
    if par.dp_shard is not None and par.dp_shard != dp:
        raise ConfigError(
            f"parallel.dp_shard × tp × pp ({par.dp_shard} × {tp} × {pp}) must be the number "
            f"of processes ({world_size}): set dp_shard = {dp}"
        )
    if tp > 1 and dp > 1 and pp == 1 and par.strategy == "ddp":
        raise ConfigError(f"tensor parallel composes with FSDP2: set parallel.strategy = 'fsdp' "
                          f"(or parallel.dp_shard = {dp}), or run {tp} processes")  # fmt: skip
    if pp > 1 and cfg.parallel.strategy == "fsdp":
        raise ConfigError("parallel.strategy = 'fsdp' cannot be combined with pipeline stages")
    per_pass = dp * cfg.optim.micro_batch
    if cfg.global_batch % per_pass:
        raise ConfigError(
            f"global batch ({cfg.global_batch} sequences) must be a multiple of micro_batch × "
            f"data-parallel ranks ({cfg.optim.micro_batch} × {dp} = {per_pass}); "
            f"try optim.global_batch = {max(per_pass, cfg.global_batch // per_pass * per_pass)}"
        )
    return Layout(
        world_size=world_size,
        dp=dp,
        pp=pp,
        tp=tp,
        micro_batch=cfg.optim.micro_batch,
        accum=cfg.global_batch // per_pass,
    )
