"""`gpucloud up` and `gpucloud server` run the control plane on this machine; `gpucloud
down` stops it.

Stopping the control plane (Ctrl-C, SIGTERM, `gpucloud down`) leaves its workloads running:
each runs in its own session, and the next control plane adopts it. `gpucloud down
--stop-workloads` stops them too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli.output import console

Port = Annotated[int, typer.Option(min=1, max=65535, help="Port of the REST API.")]
Host = Annotated[str, typer.Option(help="Address to listen on.")]
VirtualGpus = Annotated[
    int | None,
    typer.Option(min=1, help="Declare N CPU slots instead of detecting accelerators."),
]
GpuType = Annotated[str, typer.Option(help="Catalog type of virtual slots (prices usage).")]
NodeCpus = Annotated[
    float | None,
    typer.Option(min=0.001, help="CPU cores offered to workloads (default: all of them)."),
]
NodeMemory = Annotated[
    float | None,
    typer.Option(min=0.001, help="Memory in GiB offered to workloads (default: all of it)."),
]
RequestTimeout = Annotated[
    float,
    typer.Option(min=0.001, help="Seconds a request's headers and body get to arrive (408)."),
]
MaxBody = Annotated[
    int, typer.Option(min=1, help="Largest request body on the REST API, bytes (413 beyond).")
]
MaxGatewayBody = Annotated[
    int, typer.Option(min=1, help="Largest request body on /v1, the OpenAI gateway (413).")
]
Policy = Annotated[str, typer.Option(help="Scheduler preset (`gpucloud sim policies` shows them).")]
MinRun = Annotated[float, typer.Option(min=0, help="Seconds before a job may be preempted.")]
Grace = Annotated[float, typer.Option(min=0, help="Seconds between SIGTERM and SIGKILL.")]
Backoff = Annotated[float, typer.Option(min=0, help="First retry delay (doubles per retry).")]
ProbeInterval = Annotated[
    float,
    typer.Option(min=0.01, help="Seconds between health probes of a ready replica (its timeout)."),
]
SingleTenant = Annotated[
    bool,
    typer.Option(
        "--single-tenant",
        help="Run every workload as one OS user (the only mode without root); otherwise "
        "each tenant's workloads run as its own user.",
    ),
]
Export = Annotated[
    list[Path],
    typer.Option(
        "--export",
        help="A dir every tenant's workloads may use besides their own area (repeatable).",
    ),
]
MaxUpload = Annotated[
    int,
    typer.Option(min=1, help="Largest uploaded workdir or model dir, unpacked, bytes (413)."),
]
TenantUids = Annotated[
    str,
    typer.Option(
        help="The uids tenants' OS users get (FIRST-LAST; tenant N runs as FIRST+N). Give two "
        "control planes on one machine ranges that do not overlap.",
    ),
]
Executor = Annotated[
    str,
    typer.Option(
        help="Where workloads run: local (this machine), ray (a Ray cluster at --ray-address) "
        "or slurm (the Slurm cluster this machine's Slurm commands reach)."
    ),
]
RayAddress = Annotated[
    str | None, typer.Option(help="The Ray cluster's address (HOST:PORT of its GCS).")
]
NodeTimeout = Annotated[
    float,
    typer.Option(min=0.1, help="Seconds a node may go unreported before it is marked down."),
]
IdleTtl = Annotated[
    str | None,
    typer.Option(
        help="How long deployments (no request) and interactive jobs (accelerators idle) may "
        "sit idle before they are reclaimed, e.g. 2h, unless their tenant or they set their own."
    ),
]
StorageCacheMaxGb = Annotated[
    float | None,
    typer.Option(
        "--storage-cache-max-gb",
        min=0,
        help="Cap (GiB) of the cache of s3:// models and datasets on the nodes: the least "
        "recently used entries no running workload uses are evicted beyond it (default 100).",
    ),
]
Telemetry = Annotated[
    str,
    typer.Option(
        help="This node's device telemetry: auto, nvml, npu-smi, none or recorded:PATH "
        "(exported on /metrics; a fatal device error takes the node down)."
    ),
]
ProbeFailures = Annotated[
    int, typer.Option(min=1, help="Failed health probes in a row that replace a replica.")
]


def up(
    port: Port = 8470,
    host: Host = "127.0.0.1",
    virtual_gpus: VirtualGpus = None,
    gpu_type: GpuType = "L4",
    node_cpus: NodeCpus = None,
    node_memory_gib: NodeMemory = None,
    db: Annotated[str, typer.Option(help="Database URL (default: SQLite in GPUCLOUD_HOME).")] = "",
    policy: Policy = "priority",
    min_run: MinRun = 60.0,
    grace: Grace = 10.0,
    retry_backoff: Backoff = 2.0,
    probe_interval: ProbeInterval = 5.0,
    probe_failures: ProbeFailures = 3,
    request_timeout: RequestTimeout = 30.0,
    max_body_bytes: MaxBody = 1 << 20,
    max_gateway_body_bytes: MaxGatewayBody = 8 << 20,
    single_tenant: SingleTenant = False,
    max_upload_bytes: MaxUpload = 256 << 20,
    tenant_uids: TenantUids = "62000-62999",
    export: Export = [],  # noqa: B006 (typer's way to declare a repeatable option)
    executor: Executor = "local",
    ray_address: RayAddress = None,
    node_timeout: NodeTimeout = 30.0,
    telemetry: Telemetry = "auto",
    idle_ttl: IdleTtl = None,
    storage_cache_max_gb: StorageCacheMaxGb = None,
) -> None:
    """Start the control plane here and log the CLI in to it (credentials in GPUCLOUD_HOME)."""
    _run(locals(), save_credentials=True)


def server(
    db: Annotated[str, typer.Option(help="sqlite:///PATH or postgresql://USER@HOST/DB")] = "",
    port: Port = 8470,
    host: Host = "127.0.0.1",
    virtual_gpus: VirtualGpus = None,
    gpu_type: GpuType = "L4",
    node_cpus: NodeCpus = None,
    node_memory_gib: NodeMemory = None,
    policy: Policy = "priority",
    min_run: MinRun = 60.0,
    grace: Grace = 10.0,
    retry_backoff: Backoff = 2.0,
    probe_interval: ProbeInterval = 5.0,
    probe_failures: ProbeFailures = 3,
    request_timeout: RequestTimeout = 30.0,
    max_body_bytes: MaxBody = 1 << 20,
    max_gateway_body_bytes: MaxGatewayBody = 8 << 20,
    single_tenant: SingleTenant = False,
    max_upload_bytes: MaxUpload = 256 << 20,
    tenant_uids: TenantUids = "62000-62999",
    export: Export = [],  # noqa: B006 (typer's way to declare a repeatable option)
    reconcile_interval: Annotated[float, typer.Option(min=0.01)] = 1.0,
    batch_lease: Annotated[
        float,
        typer.Option(min=0.5, help="Seconds a claim on a running batch lasts unless renewed."),
    ] = 30.0,
    executor: Executor = "local",
    ray_address: RayAddress = None,
    node_timeout: NodeTimeout = 30.0,
    telemetry: Telemetry = "auto",
    idle_ttl: IdleTtl = None,
    storage_cache_max_gb: StorageCacheMaxGb = None,
) -> None:
    """Run the control plane (API, reconciler, executor) against a database."""
    _run(locals(), save_credentials=False)


def down(
    stop_workloads: Annotated[
        bool,
        typer.Option(
            "--stop-workloads",
            help="Also stop every running workload: jobs end CANCELLED; replicas wait for "
            "the next `gpucloud up` (delete a deployment to stop it for good).",
        ),
    ] = False,
) -> None:
    """Stop the control plane of this GPUCLOUD_HOME (`gpucloud up` or `gpucloud server`).
    Its running workloads keep running, and the next `gpucloud up` adopts them."""
    from gpucloud.control import db, executors, instance
    from gpucloud.control import server as control_server
    from gpucloud.control.config import Settings, home
    from gpucloud.control.reconciler import Reconciler

    where = home()
    live = instance.running(where)
    if live is not None:
        console.print(f"stopping the control plane at {live.url} (pid {live.pid})", highlight=False)
        instance.stop(live)
    else:
        console.print(f"no control plane runs for {where}", highlight=False)
    last = live or instance.read(where)
    if last is None and not (where / "state.db").exists():
        return  # no control plane ever ran here: no workloads either
    settings = Settings(home=where)
    if last is not None:
        settings.db_url, settings.grace_seconds = last.db_url, last.grace_seconds
        settings.executor, settings.ray_address = last.executor, last.ray_address
    store = db.open_store(settings.db_url)
    try:
        if stop_workloads:
            reconciler = Reconciler(store, settings, executors.create(settings))
            jobs, replicas = reconciler.stop_all(STOPPED_BY_DOWN)
            reconciler.stop()
            console.print(
                f"stopped {len(jobs)} job(s), now CANCELLED, and {len(replicas)} replica(s), "
                "which the next `gpucloud up` starts again",
                highlight=False,
            )
        else:
            console.print(_left_running(control_server.running_workloads(store)), highlight=False)
    finally:
        store.close()


def _idle_ttl(text: str | None) -> float | None:
    """--idle-ttl as seconds. Raises UserError (naming what is allowed) for a bad one."""
    from pydantic import TypeAdapter, ValidationError

    from gpucloud.control.schemas import IdleTtl
    from gpucloud.errors import UserError

    if text is None:
        return None
    try:
        return TypeAdapter(IdleTtl).validate_python(text)
    except ValidationError as e:
        raise UserError(f"--idle-ttl {text!r}: {e.errors()[0]['msg']}") from None


STOPPED_BY_DOWN = "stopped by gpucloud down --stop-workloads"


def _left_running(count: int) -> str:
    if count == 0:
        return "no workloads are running"
    return (
        f"{count} workload(s) keep running: the next `gpucloud up` adopts them, "
        "`gpucloud down --stop-workloads` stops them"
    )


def _run(opts: dict, save_credentials: bool) -> None:
    from gpucloud.control import credentials, executors, instance
    from gpucloud.control import server as control_server
    from gpucloud.control.config import Settings
    from gpucloud.scheduler import get_policy

    get_policy(opts["policy"])  # an unknown preset fails before anything starts
    settings = Settings(
        db_url=opts["db"],
        host=opts["host"],
        port=opts["port"],
        virtual_gpus=opts["virtual_gpus"],
        gpu_type=opts["gpu_type"],
        node_cpus=opts["node_cpus"],
        node_memory_gib=opts["node_memory_gib"],
        policy=opts["policy"],
        min_run=opts["min_run"],
        grace_seconds=opts["grace"],
        retry_backoff=opts["retry_backoff"],
        probe_interval=opts["probe_interval"],
        probe_failures=opts["probe_failures"],
        request_read_timeout=opts["request_timeout"],
        max_body_bytes=opts["max_body_bytes"],
        gateway_max_body_bytes=opts["max_gateway_body_bytes"],
        reconcile_interval=opts.get("reconcile_interval", 1.0),
        batch_lease=opts.get("batch_lease", 30.0),
        single_tenant=opts["single_tenant"],
        tenant_uids=_uid_range(opts["tenant_uids"]),
        max_upload_bytes=opts["max_upload_bytes"],
        exports=tuple(opts["export"]),
        executor=_executor(opts["executor"], opts["ray_address"]),
        ray_address=opts["ray_address"],
        node_timeout=opts["node_timeout"],
        telemetry=opts["telemetry"],
        idle_ttl=_idle_ttl(opts["idle_ttl"]),
        storage_cache_max_gb=opts["storage_cache_max_gb"],
    )
    instance.claim(settings)  # refused while another control plane runs for this home
    executor = executors.create(settings)
    store, key = control_server.prepare(settings, executor)
    console.print(f"gpucloud control plane at {settings.url} (API docs: {settings.url}/docs)")
    if key is not None:
        console.print(f"admin API key (shown once): {key}", highlight=False, soft_wrap=True)
        if save_credentials:
            path = credentials.save(settings.url, key)
            console.print(f"saved to {path}", highlight=False)
    elif save_credentials:
        console.print(
            f"existing state in {settings.home}; credentials in {credentials.path()}",
            highlight=False,
        )
    console.print(
        "Ctrl-C or `gpucloud down` stops the control plane; running workloads keep running "
        "and the next `gpucloud up` adopts them (`gpucloud down --stop-workloads` stops them)",
        highlight=False,
    )
    sys.stdout.flush()  # the key must reach a redirected log before the server blocks
    control_server.serve(settings, store, executor)
    console.print(
        f"control plane stopped; {_left_running(control_server.running_workloads(store))}",
        highlight=False,
    )


def _executor(name: str, ray_address: str | None) -> str:
    from gpucloud.control import executors

    if name not in executors.NAMES:
        raise typer.BadParameter(
            f"{name!r} is not an executor: use one of {', '.join(executors.NAMES)}",
            param_hint="--executor",
        )
    if (name == "ray") != (ray_address is not None):
        raise typer.BadParameter(
            "--ray-address HOST:PORT goes with --executor ray, and only with it",
            param_hint="--executor",
        )
    if ray_address is not None:
        executors.check_ray_address(ray_address)
    return name


def _uid_range(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    if not (first.isdigit() and last.isdigit() and 1000 <= int(first) <= int(last) < 2**31 - 1):
        raise typer.BadParameter(
            f"{text!r} is not a uid range: give FIRST-LAST, e.g. 62000-62999, with "
            "1000 <= FIRST <= LAST",
            param_hint="--tenant-uids",
        )
    return int(first), int(last)
