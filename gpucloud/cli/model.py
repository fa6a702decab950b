"""`gpucloud model`: the presets, what a model is made of, random-weight model dirs, and
the control plane's model registry (`register`, `list --registered`, `history`:
cli/model_registry.py).

`list` and `info PRESET` stay torch-free (spec arithmetic only); `init` imports torch.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Any

import typer

from gpucloud.cli import model_registry
from gpucloud.cli.output import JsonFlag, console, emit, human_bytes, human_count, table
from gpucloud.errors import ConfigError

app = typer.Typer(help="Model presets, model directories, random-weight models and the "
                  "model registry.", no_args_is_help=True)  # fmt: skip
app.command("register")(model_registry.register)
app.command("history")(model_registry.history)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DtypeOption = Annotated[
    str | None, typer.Option("--dtype", help="float32, bfloat16 or float16 [default: float32].")
]
InfoDtypeOption = Annotated[
    str | None,
    typer.Option("--dtype", help="float32, bfloat16 or float16 [default: the config's]."),
]


@app.command("list")
def list_(
    registered: Annotated[
        bool, typer.Option("--registered", help="The control plane's registered models instead.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """The presets: real architectures from their config.json, plus tiny and small."""
    if registered:
        model_registry.list_registered(as_json)
        return
    from gpucloud.models import PRESETS

    rows = [_describe(spec, "bfloat16") for spec in PRESETS.values()]
    emit(rows, as_json, _render_list)


@app.command("info")
def info(
    model: Annotated[str, typer.Argument(help="A preset name or an HF model directory.")],
    dtype: InfoDtypeOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Architecture, parameters (total and active), weight bytes and KV-cache bytes per token."""
    from gpucloud.models import resolve_spec

    spec = resolve_spec(model)
    path = Path(model)
    is_dir = path.is_dir() and (path / "config.json").is_file()
    data = _describe(spec, _check_dtype(dtype or (_config_dtype(path) if is_dir else None)))
    if is_dir:
        data |= _dir_facts(path, spec.vocab_size)
    emit(data, as_json, _render_info)


@app.command("init")
def init(
    out: Annotated[Path, typer.Option("--out", help="Directory to create.")],
    preset: Annotated[
        str, typer.Option("--preset", help="Preset name (see `gpucloud model list`).")
    ] = "tiny",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
    dtype: DtypeOption = None,
    force: Annotated[bool, typer.Option("--force", help="Write into a non-empty dir.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Write a random-weight model dir in HF format (weights, config, tokenizer, chat template)."""
    from gpucloud.models import resolve_spec
    from gpucloud.models.init_checks import check_init

    spec = resolve_spec(preset)
    name = _check_dtype(dtype or "float32")
    check_init(spec, out, force)  # bad input fails before torch is imported
    from gpucloud.models.loader import init_model_dir

    with console.status(f"initializing {spec.name} in {out} ...") if not as_json else nullcontext():
        init_model_dir(spec, out, seed=seed, dtype=name, force=force)
    data = _describe(resolve_spec(out), name) | _dir_facts(out, spec.vocab_size)
    emit(data, as_json, _render_info)


# ---- facts ----------------------------------------------------------------------------------
def _describe(spec: Any, dtype: str) -> dict[str, Any]:
    size = DTYPE_BYTES[dtype]
    return {
        "name": spec.name,
        "architecture": spec.architecture,
        "model_type": spec.model_type,
        "layers": spec.num_hidden_layers,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "heads": spec.num_attention_heads,
        "kv_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "experts": spec.num_local_experts,
        "experts_per_token": spec.num_experts_per_tok,
        "params": spec.num_params,
        "active_params": spec.num_active_params,
        "dtype": dtype,
        "weights_bytes": spec.num_params * size,
        "kv_bytes_per_token": int(spec.kv_bytes_per_token(size)),
    }


def _dir_facts(path: Path, config_vocab: int) -> dict[str, Any]:
    """What is on disk: weight file bytes and the tokenizer's vocabulary against the config's."""
    files = sorted(path.glob("*.safetensors"))
    facts: dict[str, Any] = {
        "path": str(path),
        "weight_files": [f.name for f in files],
        "weight_file_bytes": sum(f.stat().st_size for f in files),
        "tokenizer_vocab_size": None,
        "note": None,
    }
    if (path / "tokenizer.json").is_file():
        from gpucloud.models.tokenizer import load_tokenizer

        n = load_tokenizer(path).vocab_size
        facts["tokenizer_vocab_size"] = n
        if n < config_vocab:
            facts["note"] = (
                f"the tokenizer uses {n} of the {config_vocab} embedding rows: its BPE "
                "ran out of merges on the training text (HF allows a larger model vocab)"
            )
        elif n > config_vocab:
            facts["note"] = f"tokenizer ids up to {n - 1} exceed the model's vocab_size"
    return facts


def _config_dtype(path: Path) -> str | None:
    cfg = json.loads((path / "config.json").read_text())
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    return name if name in DTYPE_BYTES else None


def _check_dtype(name: str | None) -> str:
    name = name or "bfloat16"
    if name not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {name!r}: use one of {', '.join(DTYPE_BYTES)}")
    return name


# ---- rendering ------------------------------------------------------------------------------
def _render_list(rows: list[dict[str, Any]]) -> None:
    console.print(
        table(
            "Model presets (weights at bfloat16)",
            ["name", "architecture", "layers", "hidden", "heads/kv", "experts", "params",
             "active", "weights", "KV/token"],
            [
                (r["name"], r["architecture"], r["layers"], r["hidden_size"],
                 f"{r['heads']}/{r['kv_heads']}",
                 f"{r['experts_per_token']}/{r['experts']}" if r["experts"] > 1 else "-",
                 human_count(r["params"]), human_count(r["active_params"]),
                 human_bytes(r["weights_bytes"]), human_bytes(r["kv_bytes_per_token"]))
                for r in rows
            ],
        )
    )  # fmt: skip


def _render_info(d: dict[str, Any]) -> None:
    moe = f"{d['experts']} experts, {d['experts_per_token']} per token" if d["experts"] > 1 else ""
    rows = [
        ("architecture", f"{d['architecture']} ({d['model_type']})"),
        ("layers", d["layers"]),
        ("hidden / intermediate", f"{d['hidden_size']} / {d['intermediate_size']}"),
        ("heads / kv heads / head dim", f"{d['heads']} / {d['kv_heads']} / {d['head_dim']}"),
        ("vocab", d["vocab_size"]),
        ("context", d["max_position_embeddings"]),
        ("tied embeddings", "yes" if d["tie_word_embeddings"] else "no"),
        *([("mixture of experts", moe)] if moe else []),
        ("params", f"{d['params']:,} ({human_count(d['params'])})"),
        ("active params", f"{d['active_params']:,} ({human_count(d['active_params'])})"),
        (f"weights at {d['dtype']}", human_bytes(d["weights_bytes"])),
        (f"KV cache per token at {d['dtype']}", human_bytes(d["kv_bytes_per_token"])),
    ]
    if "path" in d:
        rows += [
            ("path", d["path"]),
            ("weight files", f"{len(d['weight_files'])} ({human_bytes(d['weight_file_bytes'])})"),
            ("tokenizer vocab", d["tokenizer_vocab_size"] or "no tokenizer.json"),
        ]
    console.print(table(d["name"], ["", "value"], rows))
    if d.get("note"):
        console.print(f"note: {d['note']}", highlight=False)
