"""`gpucloud eval`: score a model on a task file, in-process or through an OpenAI-compatible
endpoint, and `gpucloud eval compare`: the regression gate between two results."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli.groups import RunByDefault
from gpucloud.cli.output import JsonFlag, console, emit, table

app = typer.Typer(
    cls=RunByDefault,
    no_args_is_help=True,
    help="Evaluate a model on a task file and compare two results. `run` is the default "
    "command: `gpucloud eval MODEL ...` means `gpucloud eval run MODEL ...`.",
)

Target = Annotated[
    str,
    typer.Argument(
        help="A model directory, the URL of an OpenAI-compatible server, or a registered "
        "model NAME:VERSION (scored here from its files; the result is stored on it)."
    ),
]
TaskFile = Annotated[
    Path | None,
    typer.Option("--task", help="JSONL task file: multiple choice, perplexity or generation."),
]
ServedModel = Annotated[
    str | None, typer.Option("--model", help="Model name at the URL; default: its first model.")
]
ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", envvar="GPUCLOUD_API_KEY", help="Bearer key for the URL."),
]
MetricName = Annotated[
    str | None,
    typer.Option(
        help="acc, acc_norm, word_perplexity, byte_perplexity, bits_per_byte or "
        "exact_match; default: the task's first."
    ),  # fmt: skip
]
Seed = Annotated[int, typer.Option(help="Seed of the bootstrap resampling.")]
Stride = Annotated[
    int | None,
    typer.Option(
        help="Perplexity: tokens between rolling windows over a text longer than the "
        "context; default: the window's length - 1 (lm-eval's). Recorded in the result."
    ),
]
KvCacheMb = Annotated[
    int | None, typer.Option(help="In-process KV pool size; default: sized from free memory.")
]


@app.command("run")
def run(
    target: Target,
    task: TaskFile = None,
    model: ServedModel = None,
    api_key: ApiKey = None,
    metric: MetricName = None,
    seed: Seed = 0,
    stride: Stride = None,
    kv_cache_mb: KvCacheMb = None,
    as_json: JsonFlag = False,
) -> None:
    """Score a model directory or an endpoint on a task file, with a 95% bootstrap interval.
    A registered NAME:VERSION is scored in this process from its directory (an s3:// one is
    fetched into the storage cache), and the result is stored on that version."""
    from gpucloud.control.model_ref import names_registered_model
    from gpucloud.eval.results import evaluate

    loaded = _checked_task(task, metric, stride)
    if not names_registered_model(target):
        backend = _backend(target, model, api_key, kv_cache_mb)
        result = evaluate(loaded, backend, metric, seed, stride)
        emit(result, as_json, _render_result)
        return
    from gpucloud.cli.login import client
    from gpucloud.control.model_ref import parse_ref
    from gpucloud.storage import local_copy

    c = client()
    name, number = parse_ref(target)
    version = c.get(f"/models/{name}/versions/{number or 'latest'}")
    model_dir = str(local_copy(version["uri"]))
    result = evaluate(loaded, _backend(model_dir, None, None, kv_cache_mb), metric, seed, stride)
    result["model"] = version["ref"]
    c.post(f"/models/{name}/versions/{version['version']}/evals", result)
    emit(result, as_json, _render_result)
    if not as_json:
        console.print(f"stored on {version['ref']}", highlight=False)


@app.command("compare")
def compare(
    a: Annotated[
        str, typer.Argument(help="The baseline: a result JSON, a model, or NAME:VERSION.")
    ],
    b: Annotated[
        str, typer.Argument(help="The candidate: a result JSON, a model, or NAME:VERSION.")
    ],
    task: TaskFile = None,
    model: ServedModel = None,
    api_key: ApiKey = None,
    metric: MetricName = None,
    seed: Seed = 0,
    stride: Stride = None,
    kv_cache_mb: KvCacheMb = None,
    as_json: JsonFlag = False,
) -> None:
    """Fail (exit 1) when B is worse than A beyond the task's noise (paired bootstrap, 95%).

    A and B are `gpucloud eval run --json` outputs, models (directories or URLs) scored here
    on `--task`, or registered NAME:VERSIONs: their results stored on that task file (or,
    without --task, on the file the other side measured, or the one both have results on)."""
    from gpucloud.control.model_ref import names_registered_model
    from gpucloud.errors import GpucloudError
    from gpucloud.eval.compare import compare as compare_results

    refs = [x for x in (a, b) if not x.endswith(".json") and names_registered_model(x)]
    side = {
        x: _result(x, task, model, api_key, metric, seed, stride, kv_cache_mb)
        for x in (a, b) if x not in refs
    }  # fmt: skip
    if refs:
        side |= _stored_results(refs, task, metric, next(iter(side.values()), None))
    verdict = compare_results(side[a], side[b], metric, seed)
    emit(verdict, as_json, _render_verdict)
    if verdict["worse"]:
        raise GpucloudError("B is worse than A beyond noise")


def _result(target, task, model, api_key, metric, seed, stride, kv_cache_mb) -> dict:
    """A saved result when `target` is a .json file, else `target` scored on `task`."""
    from gpucloud.eval.results import evaluate, load_result

    if target.endswith(".json"):
        return load_result(target)
    loaded = _checked_task(task, metric, stride)
    return evaluate(loaded, _backend(target, model, api_key, kv_cache_mb), metric, seed, stride)


def _stored_results(
    refs: list[str], task: Path | None, metric: str | None, other: dict | None
) -> dict[str, dict]:
    """The results stored on the registered versions `refs` for one task file: `task`'s,
    else the one `other` measured, else the only one every ref has a result on."""
    from gpucloud.cli.login import client
    from gpucloud.control.model_ref import parse_ref
    from gpucloud.errors import UserError

    c = client()
    versions = {}
    for ref in refs:
        name, number = parse_ref(ref)
        versions[ref] = c.get(f"/models/{name}/versions/{number or 'latest'}")
    if task is not None:
        task_hash = _checked_task(task, metric).hash
    elif other is not None:
        task_hash = other["task_hash"]
    else:
        common = set.intersection(
            *({e["task_hash"] for e in v["evals"]} for v in versions.values())
        )
        names = {e["task_hash"]: e["task"] for v in versions.values() for e in v["evals"]}
        if len(common) != 1:
            found = ", ".join(sorted(names[h] for h in common))
            raise UserError(
                f"{' and '.join(refs)} have stored results on {len(common)} common task files"
                f"{f' ({found})' if found else ''}: choose one with --task FILE"
            )
        (task_hash,) = common
    return {
        ref: c.get(f"/models/{v['name']}/versions/{v['version']}/evals/{task_hash}")
        for ref, v in versions.items()
    }


def _checked_task(task: Path | None, metric: str | None, stride: int | None = None):
    """The task file, and its kind checked to have `metric` (and, given a `stride`, to be
    perplexity): a wrong option fails before a model is loaded."""
    from gpucloud.errors import UserError
    from gpucloud.eval.metrics import metric_for
    from gpucloud.eval.tasks import TaskKind, load_task

    loaded = load_task(_required(task))
    metric_for(loaded.kind, metric)
    if stride is not None and loaded.kind is not TaskKind.PERPLEXITY:
        raise UserError(f"--stride is for perplexity tasks; {loaded.name} is {loaded.kind}")
    if stride is not None and stride < 1:
        raise UserError(f"--stride {stride} must be at least 1 token")
    return loaded


def _backend(target: str, model: str | None, api_key: str | None, kv_cache_mb: int | None):
    if target.startswith(("http://", "https://")):
        from gpucloud.eval.endpoint import EndpointBackend

        return EndpointBackend(target, model, api_key)
    from gpucloud.eval.engine_backend import EngineBackend

    return EngineBackend(target, kv_cache_bytes=kv_cache_mb and kv_cache_mb << 20)


def _required(task: Path | None) -> Path:
    from gpucloud.errors import UserError

    if task is None:
        raise UserError("--task FILE.jsonl is required to score a model")
    return task


def _render_result(r: dict) -> None:
    rows = [
        (name, _num(m["score"]), f"{_num(m['ci_low'])} – {_num(m['ci_high'])}")
        for name, m in r["metrics"].items()
    ]
    title = f"{r['task']}: {r['kind']}, {r['n']} items"
    console.print(table(title, ["metric", "score", "95% CI"], rows))
    console.print(f"model {r['model']}\ntask {r['task_hash']}", highlight=False)


def _render_verdict(v: dict) -> None:
    better = "higher" if v["higher_is_better"] else "lower"
    console.print(
        f"{v['task']} {v['metric']} ({better} is better, {v['n']} items): "
        f"A {_num(v['a'])}, B {_num(v['b'])}, B - A {_num(v['difference'])} "
        f"(95% CI {_num(v['ci_low'])} – {_num(v['ci_high'])})",
        highlight=False,
    )
    if not v["worse"]:
        console.print("B is not worse than A")


def _num(x: float) -> str:
    return f"{x:.4g}"
