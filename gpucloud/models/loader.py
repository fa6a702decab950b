"""Hugging Face model directories ⇄ `LlamaForCausalLM`.

Loading builds the module on the meta device (no random weights are ever allocated), then
assigns the tensors of the safetensors files in place. On CPU at the stored dtype those
tensors stay memory-mapped: a 10 GB checkpoint costs no copy and pages in as it is used.
"""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from gpucloud.errors import ConfigError, UserError
from gpucloud.models import quant_config
from gpucloud.models.corpus import stdlib_text
from gpucloud.models.init_checks import check_init
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.presets import resolve_spec
from gpucloud.models.quant import QUANTIZED
from gpucloud.models.quant_formats import stored_tensors, to_layers
from gpucloud.models.spec import ModelSpec
from gpucloud.models.tensor_parallel import Shard
from gpucloud.models.tokenizer import BOS, EOS, PAD, save_tokenizer, train_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}  # fmt: skip
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")  # fmt: skip
# ~200 bytes of text per token gives BPE enough pairs; the whole corpus is ~1.4 MB.
_CORPUS_BYTES_PER_TOKEN = 200


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from `float32|bfloat16|float16` (or fp32/bf16/fp16). Raises ConfigError."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        dtype = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- load -----------------------------------------------------------------------------------
def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    quantization: str | None = None,
    shard: Shard | None = None,
) -> LlamaForCausalLM:
    """The model of an HF directory (config.json + model.safetensors, or shards listed in
    model.safetensors.index.json), in eval mode, on `device` (default CPU). A GPTQ or AWQ
    checkpoint loads as int4 layers; `quantization` (int8|int4) quantizes fp weights. With
    `shard`, only one tensor-parallel rank's part (gpucloud.models.tensor_parallel), whose
    `spec` is the rank's; the checkpoint is checked whole all the same.

    Raises ConfigError when the config or weights are missing, or names tensors that are
    missing, unexpected or of the wrong shape, or a quantization that cannot apply.
    """
    path = Path(model_dir)
    spec = ModelSpec.from_dir(path)
    quant = quant_config.requested(quantization, spec.quantization, spec.name)
    spec = replace(spec, quantization=quant)
    dtype, device = parse_dtype(dtype), torch.device(device or "cpu")
    model = _on_meta(spec)
    prefixes = [name for name, m in model.named_modules() if isinstance(m, QUANTIZED)]
    expected, optional = _stored(model, prefixes)
    if shard is None:
        state = _read_weights(path, expected, optional, dtype, device)
        if quant is not None:
            to_layers(state, prefixes, quant, dtype)
    else:  # sliced on the host: a device never holds more than its part
        state = _read_weights(path, expected, optional, dtype, torch.device("cpu"))
        stored = quant is not None and quant.checkpoint != "fp"
        if stored:  # GPTQ/AWQ: each projection unpacked whole, then sliced
            to_layers(state, prefixes, quant, dtype, shard)
            layers = {f"{p}.{k}" for p in prefixes for k in ("qweight", "scales", "zeros", "perm")}
        state = {key: t if stored and key in layers else shard.tensor(key, t)
                 for key, t in state.items()}  # fmt: skip
        if quant is not None and not stored:  # fp weights, quantized slice by slice
            to_layers(state, prefixes, quant, dtype)
        state = {key: t.to(device) for key, t in state.items()}
        model = _on_meta(shard.spec(spec))
    model.load_state_dict(state, strict=False, assign=True)
    _finish(model, device)
    return model.eval()


def _stored(
    model: LlamaForCausalLM, quantized: list[str]
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The tensors the checkpoint must hold (meta, for their shapes), and those it may omit:
    the state dict of the unquantized model, with the `quantized` layers as the checkpoint's
    format stores them."""
    spec = model.spec
    fp_model = model if spec.quantization is None else _on_meta(replace(spec, quantization=None))
    fp_state = fp_model.state_dict()
    if spec.tie_word_embeddings:
        fp_state.pop("lm_head.weight")
    if spec.quantization is None:
        return fp_state, set()
    return stored_tensors(fp_state, quantized, spec.quantization)


def _on_meta(spec: ModelSpec) -> LlamaForCausalLM:
    """The module with meta tensors: shapes only. The default initializers are skipped as in
    HF's `no_init_weights`: they would be wasted work, and their meta kernels import
    torch._dynamo on first use (seconds of startup)."""
    with _PATCH_LOCK:  # two threads patching at once would restore the no-ops for good
        saved = {name: getattr(nn.init, name) for name in _INITIALIZERS}
        try:
            for name in _INITIALIZERS:
                setattr(nn.init, name, _keep)
            with torch.device("meta"):
                return LlamaForCausalLM(spec)
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


_PATCH_LOCK = threading.Lock()
_INITIALIZERS = ("kaiming_uniform_", "uniform_", "normal_", "trunc_normal_", "zeros_", "ones_")


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def _read_weights(
    path: Path,
    expected: dict[str, torch.Tensor],
    optional: set[str],
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if key not in expected:
                    # Tied checkpoints may still carry lm_head; old ones carry rotary buffers.
                    if key != "lm_head.weight" and not key.endswith("rotary_emb.inv_freq"):
                        unexpected.append(key)
                    continue
                tensor = f.get_tensor(key)
                if tensor.shape != expected[key].shape:
                    raise ConfigError(
                        f"{file.name}: {key} has shape {list(tensor.shape)}, config.json "
                        f"implies {list(expected[key].shape)}"
                    )
                # no copy if already so; packed integers stay integers
                state[key] = tensor.to(device, dtype if tensor.is_floating_point() else None)
    missing = sorted(set(expected) - set(state) - optional)
    if missing or unexpected:
        raise ConfigError(
            f"{path}: weights do not match config.json: missing {_few(missing)}, "
            f"unexpected {_few(unexpected)}"
        )
    return state


def _weight_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ConfigError(f"{path / INDEX} is not a safetensors index: {e}") from None
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    raise ConfigError(f"{path} has neither {SINGLE} nor {INDEX} (only safetensors are read)")


def _finish(model: LlamaForCausalLM, device: torch.device) -> None:
    """Re-tie embeddings (assign replaced the shared parameter) and compute RoPE's buffer,
    which was created on the meta device."""
    if model.spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope(device)
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ConfigError(f"weights missing after load: {_few(meta)}")


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


# ---- save -----------------------------------------------------------------------------------
def save_model(
    model: LlamaForCausalLM,
    out_dir: str | Path,
    max_shard_bytes: int | None = None,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write config.json, generation_config.json and the weights as safetensors: one
    model.safetensors, or shards of at most `max_shard_bytes` (a larger tensor gets a shard
    of its own) with model.safetensors.index.json. Weight files of an earlier save in
    `out_dir` are replaced. `tokenizer_dir`: copy its tokenizer files along. Returns out_dir.
    Raises UserError for a model quantized at load (save the fp model it came from).
    """
    spec = model.spec
    if spec.quantization is not None:
        raise UserError(f"{spec.name} has {spec.quantization.method} weights: save the fp model")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        key: t.detach().to("cpu").contiguous()
        for key, t in model.state_dict().items()
        if not (spec.tie_word_embeddings and key == "lm_head.weight")  # stored once, as HF does
    }
    dtype = next(iter(tensors.values())).dtype
    for old in [*out.glob("model*.safetensors"), out / INDEX]:
        old.unlink(missing_ok=True)
    shards = _shard(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata={"format": "pt"})
    else:
        _save_sharded(shards, out)
    config = spec.to_hf_config() | {"torch_dtype": dtype_name(dtype)}
    _write_json(out / "config.json", config)
    generation = {"bos_token_id": spec.bos_token_id, "eos_token_id": spec.eos_token_id}
    _write_json(out / "generation_config.json", generation)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return out


def _shard(
    tensors: dict[str, torch.Tensor], max_bytes: int | None
) -> list[dict[str, torch.Tensor]]:
    if max_bytes is not None and max_bytes <= 0:
        raise ConfigError(f"max_shard_bytes must be positive, got {max_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += n
    return shards


def _save_sharded(shards: list[dict[str, torch.Tensor]], out: Path) -> None:
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    _write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(file: Path, data: object) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n")


# ---- init -----------------------------------------------------------------------------------
def init_model_dir(
    preset_or_spec: str | ModelSpec,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str | torch.dtype = "float32",
    force: bool = False,
) -> Path:
    """A random-weight model directory in HF format, with a byte-level BPE tokenizer trained
    on the standard library's docstrings (at most the spec's vocab_size tokens; fewer if the
    corpus runs out of merges, which HF allows). Same seed, same weights.

    Raises UserError when `out_dir` is a non-empty directory (unless `force`) or the model is
    too large to initialize here; NotFoundError for an unknown preset.
    """
    spec = preset_or_spec if isinstance(preset_or_spec, ModelSpec) else resolve_spec(
        preset_or_spec)  # fmt: skip
    torch_dtype = parse_dtype(dtype)
    out = Path(out_dir)
    check_init(spec, out, force)
    tok = train_tokenizer(spec.vocab_size, stdlib_text(spec.vocab_size * _CORPUS_BYTES_PER_TOKEN))
    spec = replace(spec, bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS))
    model = _on_meta(spec)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    _finish(model, torch.device("cpu"))
    out.mkdir(parents=True, exist_ok=True)
    save_model(model.to(torch_dtype), out)
    save_tokenizer(tok, out, model_max_length=spec.max_position_embeddings)
    generation = json.loads((out / "generation_config.json").read_text())
    generation["pad_token_id"] = tok.token_to_id(PAD)
    _write_json(out / "generation_config.json", generation)
    return out
