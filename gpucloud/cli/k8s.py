"""`gpucloud k8s render`: the manifests that run gpucloud on Kubernetes through KubeRay."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from gpucloud import __version__
from gpucloud.cli.output import console
from gpucloud.errors import UserError

app = typer.Typer(help="Kubernetes manifests (KubeRay).", no_args_is_help=True)


class Format(StrEnum):
    YAML = "yaml"
    JSON = "json"


@app.command()
def render(
    gpu_type: Annotated[
        str | None,
        typer.Option(help="Accelerator type of a worker group (`gpucloud hardware list`)."),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="Worker pods of --gpu-type (default: 1).")
    ] = None,
    gpus_per_worker: Annotated[
        int | None,
        typer.Option(help="Accelerators per worker pod (default: the type's usual server size)."),
    ] = None,
    worker_group: Annotated[
        list[str],
        typer.Option(
            help="A worker group TYPE:REPLICAS:GPUS, e.g. H100:2:8 (repeatable; with or "
            "instead of --gpu-type)."
        ),
    ] = [],  # noqa: B006 (typer's way to declare a repeatable option)
    image: Annotated[
        str, typer.Option(help="Image of every pod; it holds this package with its `ray` extra.")
    ] = f"gpucloud:{__version__}",
    name: Annotated[str, typer.Option(help="Prefix of the objects' names.")] = "gpucloud",
    namespace: Annotated[str, typer.Option(help="Namespace of every object.")] = "default",
    db_secret: Annotated[
        str | None,
        typer.Option(
            help="Secret NAME[:KEY] (key `url`) holding a postgresql:// URL for the store "
            "(default: SQLite on the home volume)."
        ),
    ] = None,
    storage: Annotated[str, typer.Option(help="Size of the home volume.")] = "10Gi",
    storage_class: Annotated[
        str | None, typer.Option(help="StorageClass of the home volume (default: the cluster's).")
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write one file per object into this directory."),
    ] = None,
    format_: Annotated[Format, typer.Option("--format", help="yaml or json.")] = Format.YAML,
) -> None:
    """Print the control plane's Deployment, Service and home volume, and a KubeRay
    RayCluster with one worker group per accelerator type; `kubectl apply -f` them."""
    from gpucloud.control import k8s

    groups = [k8s.WorkerGroup.parse(text) for text in worker_group]
    if gpu_type is not None:
        replicas = 1 if workers is None else workers
        groups.append(k8s.WorkerGroup.of(gpu_type, replicas, gpus_per_worker))
    elif workers is not None or gpus_per_worker is not None:
        raise UserError("--workers and --gpus-per-worker size the --gpu-type group: give it")
    spec = k8s.Spec(
        image=image,
        groups=tuple(groups),
        name=name,
        namespace=namespace,
        db_secret=db_secret,
        storage=storage,
        storage_class=storage_class,
    )
    objects = k8s.render(spec)
    if output is None:
        typer.echo(_dump_all(objects, format_), nl=False)
        return
    output.mkdir(parents=True, exist_ok=True)
    for obj in objects:
        path = output / f"{obj['kind'].lower()}-{obj['metadata']['name']}.{format_}"
        path.write_text(_dump(obj, format_))
        console.print(f"wrote {path}", highlight=False, soft_wrap=True)


def _dump(obj: dict, format_: Format) -> str:
    if format_ is Format.JSON:
        return json.dumps(obj, indent=2) + "\n"
    import yaml

    class Plain(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:
            return True  # a dict used twice (labels, selector) is written twice, not as &id001

    return yaml.dump(obj, Dumper=Plain, sort_keys=False)


def _dump_all(objects: list[dict], format_: Format) -> str:
    """One stream: YAML documents, or a JSON `List` (both are what `kubectl apply -f -` reads)."""
    if format_ is Format.JSON:
        return _dump({"apiVersion": "v1", "kind": "List", "items": objects}, format_)
    return "---\n".join(_dump(obj, format_) for obj in objects)
