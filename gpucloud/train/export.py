"""`gpucloud train export`: a sharded training checkpoint → an HF-format model directory.

DCP reassembles every rank's shards into full tensors in this one process (no process
group), whatever the strategy and world size that wrote them; the loader's `save_model`
writes config.json and safetensors, and the tokenizer the data was prepared with is
copied along, so `gpucloud serve` and `transformers` load the result unchanged.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp

from gpucloud import storage
from gpucloud.errors import UserError
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.spec import ModelSpec
from gpucloud.storage import Location
from gpucloud.train.checkpoint import reader, resolve


def export(checkpoint: Location, out: Path, dtype: str = "float32", force: bool = False) -> dict:
    """Write the model of `checkpoint` (a step dir, a checkpoints dir or a run dir; a path or
    a URL) to `out`: an HF model directory, or a PEFT adapter directory for a LoRA run.

    Returns a summary (checkpoint, step, out, params). Raises ConfigError when no committed
    checkpoint is found, UserError when `out` is a non-empty directory and not `force`.
    """
    from gpucloud.models.loader import parse_dtype, save_model

    path = resolve(checkpoint)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"{out} is not empty: choose a new --out or pass --force")
    extra = json.loads(storage.read_bytes(storage.join(path, "train.json")))
    if "adapter" in extra:  # a LoRA run: its adapters, in PEFT's format
        from gpucloud.train.lora_train import export_adapter

        return export_adapter(path, extra, out, force)
    spec = ModelSpec.from_hf_config(extra["model_config"], name=out.name)
    model = LlamaForCausalLM(spec)
    # Prefix "model." as the trainer saves {"model": ..., "optim": ...}.
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP warns that no process group exists: none is needed
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader(path), no_dist=True)
    model.load_state_dict(state["model"])
    tokenizer = extra.get("tokenizer")
    if tokenizer and not (Path(tokenizer) / "tokenizer.json").is_file():
        tokenizer = None
    save_model(model.to(parse_dtype(dtype)), out, tokenizer_dir=tokenizer)
    return {
        "checkpoint": str(path),
        "step": extra["step"],
        "out": str(out),
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": str(parse_dtype(dtype)).removeprefix("torch."),
        "tokenizer": tokenizer,
    }
