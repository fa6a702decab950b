"""`gpucloud model register | list --registered | history`: the control plane's model
registry. The files are hashed here, where the CLI reads them; the control plane keeps the
record (services/registry.py). Torch is imported only to read a run dir's checkpoints."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from gpucloud.cli.login import client
from gpucloud.cli.output import JsonFlag, console, emit, table

ModelName = Annotated[str, typer.Argument(help="The model's name in the registry.")]


def register(
    name: ModelName,
    location: Annotated[
        str, typer.Argument(help="The model directory, or an s3:// URL of one: it stays there.")
    ],
    base: Annotated[
        str | None, typer.Option(help="The registered NAME:VERSION it was trained from.")
    ] = None,
    dataset: Annotated[
        str | None, typer.Option(help="The data it was trained on (hashed); default: the run's.")
    ] = None,
    run: Annotated[
        Path | None,
        typer.Option(help="Its `gpucloud train` run dir: base model, dataset, config, step."),
    ] = None,
    sha256: Annotated[
        str | None,
        typer.Option(help="Your own hash of the content (hex), e.g. of an s3:// model."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Record a version of NAME: the content hash of its weights, config and tokenizer
    (sha256 of each file; for an s3:// URL the objects' ETags, or --sha256), and what
    produced it. Versions are numbered per name; content already registered under NAME
    gives back that version, and nothing is added."""
    from gpucloud.control.registry_schemas import ModelRegister
    from gpucloud.models.content import model_content, tree_content
    from gpucloud.storage import is_url

    uri = location if is_url(location) else os.path.abspath(location)
    content = model_content(uri)
    lineage: dict[str, Any] = {"base": base}
    if run is not None:
        from gpucloud.train.lineage import run_lineage

        lineage |= run_lineage(run)
    if dataset is not None:
        lineage |= {"dataset": dataset, "dataset_hash": tree_content(dataset).hash}
    body = ModelRegister(
        uri=uri,
        content_hash=_given(sha256) if sha256 else content.hash,
        hash_kind="given" if sha256 else content.kind,
        files=content.files,
        **lineage,
    )
    v = client().post(f"/models/{name}/versions", body.model_dump(exclude_none=True))
    emit(v, as_json, _render_registered)


def list_registered(as_json: bool) -> None:
    """The registry's models (every tenant's for an operator) and their latest versions."""
    rows = client().get("/models")
    emit(rows, as_json, _render_models)


def history(
    name: ModelName,
    tenant: Annotated[str | None, typer.Option(help="Operators: another tenant's.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """NAME's lineage: the version it started from, each version with what produced it, and
    their eval results."""
    emit(client().get(f"/models/{name}/history", tenant=tenant), as_json, _render_history)


def _given(sha256: str) -> str:
    from gpucloud.errors import UserError

    digest = sha256.lower().removeprefix("sha256:")
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise UserError(f"--sha256 {sha256!r}: give 64 hex digits")
    return "sha256:" + digest


# ---- rendering ------------------------------------------------------------------------------
def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M")


def _short(digest: str | None) -> str:
    return "" if digest is None else digest[:19]


def _render_registered(v: dict) -> None:
    files = f"{len(v['files'])} files, {v['hash_kind']}"
    if v["created"]:
        line = f"registered {v['ref']}: {_short(v['content_hash'])} ({files}) at {v['uri']}"
    else:
        line = f"{v['ref']} has this content already ({_short(v['content_hash'])}): nothing added"
    console.print(line, highlight=False)
    if v["created"] and (v["base"] or v["base_model"]):
        console.print(f"from {v['base'] or v['base_model']}", highlight=False)


def _render_models(rows: list[dict]) -> None:
    console.print(
        table(
            "Registered models",
            ["tenant", "name", "versions", "latest", "uri", "registered"],
            [
                (
                    r["tenant"],
                    r["name"],
                    r["versions"],
                    r["latest"],
                    r["uri"],
                    _when(r["created_at"]),
                )
                for r in rows
            ],
        )
    )


def _render_history(h: dict) -> None:
    versions = [*h["bases"], *h["versions"]]
    console.print(
        table(
            f"Lineage of {h['name']}",
            ["version", "from", "content", "step", "dataset", "registered"],
            [
                (
                    v["ref"],
                    v["base"] or v["base_model"] or "",
                    _short(v["content_hash"]),
                    "" if v["step"] is None else v["step"],
                    _short(v["dataset_hash"]),
                    _when(v["created_at"]),
                )
                for v in versions
            ],  # fmt: skip
        )
    )
    evals = [(v["ref"], e) for v in versions for e in v["evals"]]
    if evals:
        console.print(
            table(
                "Evals",
                ["version", "task", "metric", "score", "95% CI", "n"],
                [
                    (
                        ref,
                        f"{e['task']} {e['task_hash'][7:15]}",
                        e["metric"],
                        f"{e['score']:.4g}",
                        f"{e['ci_low']:.4g} – {e['ci_high']:.4g}",
                        e["n"],
                    )
                    for ref, e in evals
                ],  # fmt: skip
            )
        )
