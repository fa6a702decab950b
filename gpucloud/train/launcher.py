"""Check a run before any process starts, then run torchrun and report how it ended.

The exit code is the contract with whoever launched us (a person, or the control plane):

    0   completed: max_steps reached, final checkpoint committed
    1   failed: workers kept crashing past launch.max_restarts
    2   bad input: the config cannot work (nothing was started)
    3   stopped by the health policy (NaN/inf or grad-norm spike with action "stop")
    4   hung: a step outlived health.hang_timeout_s (a rank stopped, a collective never
        completed) on the last attempt torchrun made; retryable: launching again resumes
    5   a straggler was reported and health.exclude_stragglers is on: a checkpoint was
        saved and status.json names its rank and node ("straggler"); launching again
        without that node resumes
    143 terminated by SIGTERM: a checkpoint was saved; launching again resumes
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from enum import IntEnum
from pathlib import Path

from gpucloud import storage
from gpucloud.errors import ConfigError
from gpucloud.hal import device as hal_device
from gpucloud.models.presets import resolve_spec
from gpucloud.models.spec import ModelSpec
from gpucloud.train import config
from gpucloud.train.config import Layout, RunConfig, layout
from gpucloud.train.data import read_info
from gpucloud.train.metrics import METRICS_FILE, MetricsFollower

CONFIG_FILE = "config.json"  # the resolved config the workers read
SOURCES_FILE = "sources.json"  # the URLs of inputs config.json names by their local copies
STATUS_FILE = "status.json"  # how the last attempt ended, written by rank 0
_POLL_SECONDS = 0.2  # how often the launcher looks for new metrics while torchrun runs


class ExitCode(IntEnum):
    COMPLETED = 0
    FAILED = 1
    BAD_INPUT = 2
    STOPPED = 3
    HUNG = 4  # = stragglers.HUNG_EXIT, the worker's own exit code after a hang
    STRAGGLING_NODE = 5
    TERMINATED = 143


OUTCOME_CODES = {
    "completed": ExitCode.COMPLETED,
    "stopped": ExitCode.STOPPED,
    "terminated": ExitCode.TERMINATED,
    "hung": ExitCode.HUNG,
    "straggling_node": ExitCode.STRAGGLING_NODE,
}


def preflight(
    cfg: RunConfig, nproc_per_node: int, nnodes: int = 1, backend: hal_device.Backend | None = None
) -> Layout:
    """Everything that can be checked here: layout, model, data, backend (the detected one
    unless given). Raises ConfigError saying what to change."""
    lay = layout(cfg, nproc_per_node * nnodes)
    spec = resolve_spec(cfg.model.path or cfg.model.preset)
    if spec.num_hidden_layers % lay.pp:
        raise ConfigError(
            f"parallel.pipeline_stages ({lay.pp}) must divide the model's "
            f"{spec.num_hidden_layers} layers"
        )
    if cfg.moe is not None and not spec.is_moe:
        raise ConfigError(f"[moe] applies to mixture-of-experts models; {spec.name} is dense: "
                          "remove the [moe] section")  # fmt: skip
    if spec.is_moe and lay.pp > 1:
        raise ConfigError("mixture-of-experts models train with parallel.strategy = 'ddp' or "
                          "'fsdp' (the pipeline does not carry the load-balancing loss): set "
                          "parallel.pipeline_stages = 1")  # fmt: skip
    if lay.tp > 1:
        _check_tp(spec, lay.tp)
    if lay.ep > 1:
        _check_ep(spec, lay)
    if cfg.checkpoint.dir and storage.is_url(cfg.checkpoint.dir):
        storage.check_reachable(cfg.checkpoint.dir)
    backend = backend or hal_device.detect()
    if cfg.parallel.strategy == "fsdp" and not backend.supports_fsdp:
        raise ConfigError(f"the {backend.name} backend has no FSDP: use parallel.strategy = 'ddp'")
    if cfg.precision.dtype == "bf16" and not backend.supports_bf16:
        raise ConfigError(f"the {backend.name} backend has no bf16: use fp16 or fp32")
    devices = hal_device.device_count(backend)
    if backend.name != "cpu" and nproc_per_node > devices:
        raise ConfigError(
            f"--nproc-per-node {nproc_per_node} exceeds the {devices} {backend.name} devices here"
        )
    if cfg.data.seq_len > spec.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len ({cfg.data.seq_len}) exceeds the model's max_position_embeddings "
            f"({spec.max_position_embeddings})"
        )
    if cfg.recipe.kind != "pretrain":  # a JSONL file, read and checked by the workers
        if not Path(cfg.data.path).is_file():
            raise ConfigError(f"data.path {cfg.data.path}: no such file (recipe.kind = "
                              f"'{cfg.recipe.kind}' reads a JSONL file)")  # fmt: skip
        return lay
    info = read_info(cfg.data.path)
    if info.vocab_size > spec.vocab_size:
        raise ConfigError(
            f"{cfg.data.path} was tokenized with {info.vocab_size} token ids but the model has "
            f"vocab_size {spec.vocab_size}: prepare the data with the model's tokenizer"
        )
    if info.tokens("train") < cfg.data.seq_len + 1:
        raise ConfigError(
            f"{cfg.data.path} has {info.tokens('train')} training tokens, fewer than one "
            f"sequence of data.seq_len + 1 = {cfg.data.seq_len + 1}"
        )
    return lay


def _check_tp(spec: ModelSpec, tp: int) -> None:
    """Raise ConfigError unless `tp.parallelize` can split `spec` evenly over `tp` ranks."""
    if spec.is_moe or spec.quantization:
        raise ConfigError(f"parallel.tp > 1 splits dense unquantized layers; {spec.name} "
                          "has other ones")  # fmt: skip
    sizes = {
        "attention heads": spec.num_attention_heads,
        "KV heads": spec.num_key_value_heads,
        "vocabulary entries": spec.vocab_size,
        "MLP channels (intermediate_size)": spec.intermediate_size,
    }
    for what, n in sizes.items():
        if n % tp:
            raise ConfigError(f"parallel.tp ({tp}) must divide the model's {n} {what}")


def _check_ep(spec: ModelSpec, lay: Layout) -> None:
    """Raise ConfigError unless `expert_parallel` can split `spec`'s experts over `lay.ep`
    data-parallel ranks (DDP or FSDP2: tensor parallel and pipeline stages already refuse
    mixture-of-experts models)."""
    ep = lay.ep
    if not spec.is_moe:
        raise ConfigError(f"parallel.ep shards the experts of mixture-of-experts models; "
                          f"{spec.name} is dense: set parallel.ep = 1")  # fmt: skip
    if spec.num_local_experts % ep:
        raise ConfigError(f"parallel.ep ({ep}) must divide the model's "
                          f"{spec.num_local_experts} experts")  # fmt: skip


def fetch_inputs(cfg: RunConfig) -> RunConfig:
    """The config with a dataset or model dir given as a URL replaced by its local copy,
    fetched once into the storage cache: every rank reads them through memory maps.
    Raises UserError naming the URL when it cannot be read."""
    model, data = cfg.model, cfg.data
    if storage.is_url(data.path):
        data = data.model_copy(update={"path": str(storage.local_copy(data.path))})
    if model.path is not None and storage.is_url(model.path):
        model = model.model_copy(update={"path": str(storage.local_copy(model.path))})
    return cfg.model_copy(update={"model": model, "data": data})


def input_urls(cfg: RunConfig) -> dict[str, str]:
    """The inputs `cfg` gives as URLs, by config key: {"model.path": "s3://...", ...}."""
    inputs = {"model.path": cfg.model.path, "data.path": cfg.data.path}
    return {key: v for key, v in inputs.items() if v is not None and storage.is_url(v)}


def prepare_run_dir(cfg: RunConfig, run_dir: Path, sources: dict[str, str]) -> None:
    """Write the resolved config the workers read, and `sources` when there are any
    (input_urls of the config as given: the lineage names those, not the cache); clear the
    previous attempt's status."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config.save(cfg, run_dir / CONFIG_FILE)
    if sources:
        (run_dir / SOURCES_FILE).write_text(json.dumps(sources, indent=1) + "\n")
    else:
        (run_dir / SOURCES_FILE).unlink(missing_ok=True)
    (run_dir / STATUS_FILE).unlink(missing_ok=True)


def torchrun_command(
    cfg: RunConfig,
    run_dir: Path,
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "gpucloud",
    local_addr: str | None = None,
) -> list[str]:
    # c10d rendezvous: in-place restarts re-create process groups reliably with it (the
    # static rendezvous hung on restart here). --standalone is c10d on a free local port.
    # torchrun knows a node by its address (default: its host name) and its agent's pid, and
    # gives the other nodes the first node's address to reach: `local_addr` is this node's
    # address as the others reach it; it also keeps apart nodes that share a host name, whose
    # agents have the same pid in their sandboxes' PID namespaces.
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    cmd.append(f"--max-restarts={cfg.launch.max_restarts}")
    if rdzv_endpoint is None:
        if nnodes != 1:
            raise ConfigError("--nnodes > 1 needs --rdzv HOST:PORT (the rendezvous endpoint)")
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        cmd.append(f"--rdzv-id={rdzv_id}")
        if local_addr:
            cmd.append(f"--local-addr={local_addr}")
    return [*cmd, "-m", "gpucloud.train.worker", "--run-dir", str(run_dir)]


def run(
    cmd: list[str],
    run_dir: Path,
    on_record: Callable[[dict], None] = lambda record: None,
) -> ExitCode:
    """Run torchrun to the end, forwarding SIGTERM/SIGINT, and map the outcome to a code.
    Meanwhile each record rank 0 appends to metrics.jsonl goes to `on_record`."""
    metrics = MetricsFollower(run_dir / METRICS_FILE)
    proc = subprocess.Popen(cmd)

    def forward(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = None
        while rc is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = proc.wait(timeout=_POLL_SECONDS)
            for record in metrics.new_records():
                on_record(record)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    status = read_status(run_dir)
    if status is not None:
        return OUTCOME_CODES[status["outcome"]]
    return ExitCode.COMPLETED if rc == 0 else ExitCode.FAILED


def write_status(
    run_dir: Path, outcome: str, step: int, attempt: int, rank: int = 0,
    straggler: dict | None = None,
) -> None:  # fmt: skip
    """Record how this attempt ended (atomically: the launcher may read it at any time);
    with `straggler`, the metrics record of the straggler that ended it."""
    status = {"outcome": str(outcome), "step": step, "attempt": attempt}
    if straggler is not None:
        status["straggler"] = straggler
    tmp = run_dir / f"{STATUS_FILE}.{rank}.tmp"  # ranks that hang all write it
    tmp.write_text(json.dumps(status) + "\n")
    tmp.replace(run_dir / STATUS_FILE)


def read_status(run_dir: Path) -> dict | None:
    file = run_dir / STATUS_FILE
    return json.loads(file.read_text()) if file.is_file() else None
