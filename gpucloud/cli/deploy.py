"""`gpucloud deploy`: model-serving deployments on the control plane."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli.login import client
from gpucloud.cli.output import JsonFlag, console, emit, table

app = typer.Typer(help="Deployments: replicas of `gpucloud serve MODEL_DIR`.", no_args_is_help=True)
Name = Annotated[str, typer.Argument(help="Deployment name.")]
_WARM_POOL = typer.Option(
    min=0,
    max=64,
    help="Replicas kept started with their weights loaded but not routed: a scale-up (from "
    "zero too) promotes one at once. They hold GPUs: they count against quota and budget.",
)


def _render(rows: list[dict]) -> None:
    console.print(
        table(
            "Deployments",
            [
                "name",
                "model",
                "state",
                "ready",
                "restarts",
                "gpus/replica",
                "replicas (state url)",
                "idle",
            ],  # fmt: skip
            [
                (
                    d["name"],
                    _models(d),
                    d["state"],
                    _ready(d),
                    str(d["restarts"]),
                    f"{d['gpus_per_replica']} x {d['gpu_type'] or 'any'}",
                    " ".join(
                        f"{_version(d, r)}{r['state']}{' ' + r['url'] if r['url'] else ''}"
                        for r in d["replica_list"]
                    ),
                    d.get("idle") or "",
                )
                for d in rows
            ],
        )
    )


def _ready(d: dict) -> str:
    """READY replicas of the served versions over those they route (a canary's counted with
    the stable's), and the warm pool's loaded ones over its size."""
    shown = f"{d['ready_replicas']}/{d['routed_replicas']}"
    return shown + (f" +{d['warm_replicas']}/{d['warm_pool']} warm" if d["warm_pool"] else "")


def _versioned(d: dict) -> bool:
    """Whether the deployment ever had a version but its first (then the views name them)."""
    return d["version"] != 1 or d["canary"] is not None


def _models(d: dict) -> str:
    """The stable version's model, and the canary's beside it with its share."""
    model = d.get("model") or d["model_dir"]
    if not _versioned(d):
        return model
    c, stable = d["canary"], f"v{d['version']} {model}"
    if c is None:
        return stable
    return f"{stable}\nv{c['number']} {c.get('model_ref') or c['model_dir']} ({c['percent']:g}%)"


def _version(d: dict, replica: dict) -> str:
    return f"v{replica['version']} " if _versioned(d) else ""


@app.command("create")
def create(
    name: Name,
    model_dir: Annotated[
        str,
        typer.Argument(
            help="HF-format model directory to serve, an s3:// URL of one, or a registered "
            "model: NAME:VERSION (NAME: its latest)."
        ),
    ],
    replicas: Annotated[int, typer.Option(min=0)] = 1,
    max_replicas: Annotated[
        int | None, typer.Option(min=1, help="Autoscale up to this many replicas by load.")
    ] = None,
    min_replicas: Annotated[
        int, typer.Option(min=0, help="Autoscale floor; 0: no replica while idle.")
    ] = 1,
    target_in_flight: Annotated[
        float, typer.Option(help="Autoscale: requests in flight per replica to aim for.")
    ] = 4.0,
    scale_down_delay: Annotated[
        float, typer.Option(help="Autoscale: seconds of lower load before shrinking.")
    ] = 60.0,
    max_cold_wait: Annotated[
        float,
        typer.Option(help="Autoscale: seconds a request waits for a replica to start."),
    ] = 120.0,
    warm_pool: Annotated[int, _WARM_POOL] = 0,
    gpus_per_replica: Annotated[int, typer.Option(min=1)] = 1,
    gpu_type: Annotated[str | None, typer.Option(help="Catalog GPU type (any if unset).")] = None,
    cpus: Annotated[float, typer.Option(help="CPU cores per replica (0: none requested).")] = 0,
    memory_gib: Annotated[float, typer.Option(help="Host memory per replica, GiB.")] = 0,
    priority: Annotated[str, typer.Option(help="low | normal | high")] = "high",
    preemptible: bool = False,
    batch_in_flight: Annotated[
        int,
        typer.Option(
            min=1,
            help="Batch-class requests let in at once per ready replica (the rest wait in the "
            "gateway, so interactive ones keep their latency).",
        ),
    ] = 2,
    engine_arg: Annotated[
        list[str] | None, typer.Option(help="Extra flag for `gpucloud serve` (repeat).")
    ] = None,
    command: Annotated[
        str | None,
        typer.Option(help="Serve with this command instead; {port} and {model_dir} are filled in."),
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(
            "--env",
            help="NAME=VALUE for the replicas' environment (repeat); a bare NAME passes this "
            "shell's value, e.g. --env AWS_SECRET_ACCESS_KEY for an s3:// model.",
        ),
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(help="KEY=VALUE tag (repeat), e.g. team=ml: showback and budgets."),
    ] = None,
    idle_ttl: Annotated[
        str | None,
        typer.Option(
            help="Scale to zero after this long without a request, e.g. 2h (the next request "
            "starts it again); 0: never. Default: the tenant's, else the cluster's."
        ),
    ] = None,
    upload: Annotated[
        bool,
        typer.Option(
            "--upload",
            help="Upload MODEL_DIR into your tenant's area first: for a model the tenant's "
            "workloads (its own OS user) cannot read where it is.",
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Create NAME: REPLICAS processes serving MODEL_DIR, each on its own GPUs; with
    --max-replicas, the load through the /v1 gateway sets how many, from --min-replicas.

    Replicas run as your tenant's OS user: MODEL_DIR must be readable by it (in your
    tenant's area, a dir the admin exported, or world-readable), or sent with --upload. An
    s3:// MODEL_DIR is fetched by each replica with the AWS_* variables given by --env."""
    from pydantic import ValidationError

    from gpucloud.control import specfile
    from gpucloud.control.model_ref import names_registered_model
    from gpucloud.control.schemas import DeploymentSpec
    from gpucloud.errors import UserError
    from gpucloud.storage import is_url

    if upload and (is_url(model_dir) or names_registered_model(model_dir)):
        raise UserError(f"--upload sends a local dir; {model_dir} is fetched by the replicas")
    try:
        spec = DeploymentSpec(
            name=name,
            **_model(model_dir),
            env=_env(env or []),
            replicas=replicas,
            autoscale=None
            if max_replicas is None
            else {
                "min_replicas": min_replicas,
                "max_replicas": max_replicas,
                "target_in_flight": target_in_flight,
                "scale_down_delay": scale_down_delay,
                "max_cold_wait": max_cold_wait,
            },
            warm_pool=warm_pool,
            gpus_per_replica=gpus_per_replica,
            gpu_type=gpu_type,
            cpus=cpus,
            memory_gib=memory_gib,
            priority=priority,
            preemptible=preemptible,
            batch_in_flight=batch_in_flight,
            engine_args=engine_arg or [],
            command=command,
            labels=_labels(label or []),
            idle_ttl=idle_ttl,
        )
    except ValidationError as e:
        raise UserError(specfile.explain(e, DeploymentSpec)) from None
    c = client()
    if upload:
        from gpucloud.cli.upload import upload as send

        spec.model_dir = send(c, Path(spec.model_dir))
    d = c.post("/deployments", spec.model_dump(exclude_none=True))
    emit(
        d,
        as_json,
        lambda d: console.print(
            f"deployment {d['name']} created with {d['replicas']} replica(s)", highlight=False
        ),
    )


@app.command("list")
def list_(as_json: JsonFlag = False) -> None:
    """Your tenant's deployments and their replicas."""
    emit(client().get("/deployments"), as_json, _render)


@app.command("get")
def get(name: Name, as_json: JsonFlag = False) -> None:
    """One deployment and its replicas."""
    emit(client().get(f"/deployments/{name}"), as_json, lambda d: _render([d]))


@app.command("scale")
def scale(
    name: Name, replicas: Annotated[int, typer.Argument(min=0)], as_json: JsonFlag = False
) -> None:
    """Change the number of replicas."""
    emit(
        client().post(f"/deployments/{name}/scale", {"replicas": replicas}),
        as_json,
        lambda d: _render([d]),
    )


@app.command("update")
def update(
    name: Name, warm_pool: Annotated[int | None, _WARM_POOL] = None, as_json: JsonFlag = False
) -> None:
    """Change NAME's settings that take effect without a new version: its warm pool."""
    from gpucloud.errors import UserError

    if warm_pool is None:
        raise UserError("nothing to update: give --warm-pool N")
    d = client().patch(f"/deployments/{name}", {"warm_pool": warm_pool})
    emit(d, as_json, lambda d: _render([d]))


@app.command("rollout")
def rollout(
    name: Name,
    model: Annotated[
        str,
        typer.Option(
            help="The new version's model directory, an s3:// URL of one, or a registered "
            "model: NAME:VERSION."
        ),
    ],
    canary: Annotated[
        float, typer.Option(min=0.01, max=100, help="Percent of the requests it takes.")
    ] = 10.0,
    engine_arg: Annotated[
        list[str] | None, typer.Option(help="Extra flag for its `gpucloud serve` (repeat).")
    ] = None,
    command: Annotated[
        str | None,
        typer.Option(help="Serve it with this command; {port} and {model_dir} are filled in."),
    ] = None,
    auto_rollback: Annotated[
        bool, typer.Option(help="Roll it back by itself when it does worse than stable.")
    ] = True,
    window: Annotated[float, typer.Option(help="Seconds of requests compared.")] = 60.0,
    min_requests: Annotated[
        int, typer.Option(help="Canary requests in the window before it is judged.")
    ] = 20,
    max_error_rise: Annotated[
        float, typer.Option(help="Canary error rate minus stable's, at most (0.05: 5 points).")
    ] = 0.05,
    max_ttft_ratio: Annotated[
        float, typer.Option(help="Canary p99 time to first token over stable's, at most.")
    ] = 2.0,
    require_eval: Annotated[
        Path | None,
        typer.Option(
            help="A task file: `promote` then needs the canary's stored eval result on it (from "
            "`gpucloud eval` of its NAME:VERSION) not worse than stable's, by `eval compare`."
        ),
    ] = None,
    max_restarts: Annotated[
        int, typer.Option(min=1, help="Restarts of its replicas that roll it back.")
    ] = 3,
    ready_within: Annotated[
        float, typer.Option(help="Seconds by which one of its replicas must be ready.")
    ] = 300.0,
    as_json: JsonFlag = False,
) -> None:
    """Start a new version of NAME beside its stable one, taking --canary percent of the
    requests (a request with a `user` always goes to the same version); then `promote` or
    `rollback` it. Unless --no-auto-rollback, the control plane rolls it back by itself
    when its error rate or p99 time to first token breaks the bounds over --window, or when
    it does not get going (--max-restarts, --ready-within)."""
    from pydantic import ValidationError

    from gpucloud.control import specfile
    from gpucloud.control.schemas import RolloutSpec
    from gpucloud.errors import UserError

    guard = {
        "window": window,
        "min_requests": min_requests,
        "max_error_rate_increase": max_error_rise,
        "max_ttft_ratio": max_ttft_ratio,
        "max_restarts": max_restarts,
        "ready_within": ready_within,
    }
    try:
        spec = RolloutSpec(
            **_model(model),
            engine_args=engine_arg or [],
            command=command,
            canary=canary,
            guard=guard if auto_rollback else None,
            require_eval=_eval_gate(require_eval) if require_eval else None,
        )
    except ValidationError as e:
        raise UserError(specfile.explain(e, RolloutSpec)) from None
    d = client().post(f"/deployments/{name}/rollout", spec.model_dump(exclude_none=True))
    emit(d, as_json, lambda d: console.print(_split(d), highlight=False))


@app.command("promote")
def promote(name: Name, as_json: JsonFlag = False) -> None:
    """Make NAME's canary its stable version; the old one finishes its requests, then stops."""
    d = client().post(f"/deployments/{name}/promote", {})
    emit(d, as_json, lambda d: console.print(_split(d), highlight=False))


@app.command("rollback")
def rollback(name: Name, as_json: JsonFlag = False) -> None:
    """Drop NAME's canary: it finishes its requests, then stops; stable takes them all."""
    d = client().post(f"/deployments/{name}/rollback", {})
    emit(d, as_json, lambda d: console.print(_split(d), highlight=False))


@app.command("history")
def history(name: Name, as_json: JsonFlag = False) -> None:
    """NAME's versions, and its traffic split after each change."""
    from datetime import UTC, datetime

    def when(at: float | None) -> str:
        return "" if at is None else datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S")

    def render(h: dict) -> None:
        console.print(
            table(
                f"Versions of {h['name']}",
                ["version", "model", "state", "share", "created", "ended", "why"],
                [
                    (
                        str(v["number"]),
                        v.get("model_ref") or v["model_dir"],
                        v["state"],
                        f"{v['percent']:g}%",
                        when(v["created_at"]),
                        when(v["ended_at"]),
                        v["reason"] or "",
                    )
                    for v in h["versions"]
                ],  # fmt: skip
            )
        )
        console.print(
            table(
                "Traffic",
                ["at", "action", "by", "split", "why"],
                [
                    (
                        when(e["at"]),
                        e["action"],
                        e["user"] or "control plane",
                        _shares(e["traffic"]),
                        e["reason"] or "",
                    )
                    for e in h["events"]
                ],  # fmt: skip
            )
        )

    emit(client().get(f"/deployments/{name}/history"), as_json, render)


def _shares(traffic: dict[str, float]) -> str:
    return ", ".join(f"v{v} {p:g}%" for v, p in sorted(traffic.items(), key=lambda x: int(x[0])))


def _split(d: dict) -> str:
    """One line: the deployment's versions and their shares of the requests."""
    c = d["canary"]
    if c is None:
        return f"deployment {d['name']}: version {d['version']} takes every request"
    return (
        f"deployment {d['name']}: version {d['version']} {100 - c['percent']:g}%, "
        f"canary version {c['number']} {c['percent']:g}%"
    )


@app.command("delete")
def delete(name: Name, as_json: JsonFlag = False) -> None:
    """Stop every replica and remove the deployment."""
    emit(
        client().delete(f"/deployments/{name}"),
        as_json,
        lambda d: console.print(f"deployment {d['name']}: deleting", highlight=False),
    )


def _model(text: str) -> dict[str, str]:
    """The spec's model: a registered NAME:VERSION, a URL, or a path (made absolute: replicas
    run in their own directories, and a relative path means what it means here)."""
    from gpucloud.control.model_ref import names_registered_model
    from gpucloud.storage import is_url

    if names_registered_model(text):
        return {"model": text}
    return {"model_dir": text if is_url(text) else os.path.abspath(text)}


def _eval_gate(task_file: Path) -> dict[str, str]:
    """The task file (checked) a promotion requires a result on: its name and sha256."""
    from gpucloud.eval.tasks import load_task

    task = load_task(task_file)
    return {"task": task.name, "task_hash": task.hash}


def _env(pairs: list[str]) -> dict[str, str]:
    """--env NAME=VALUE pairs; a bare NAME takes this shell's value."""
    from gpucloud.errors import UserError

    env = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq:
            if name not in os.environ:
                raise UserError(f"--env {name}: not set in this shell (give NAME=VALUE)")
            value = os.environ[name]
        env[name] = value
    return env


def _labels(pairs: list[str]) -> dict[str, str]:
    """--label KEY=VALUE pairs."""
    from gpucloud.errors import UserError

    labels = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise UserError(f"--label {pair!r}: give KEY=VALUE, e.g. team=ml")
        labels[key] = value
    return labels
