"""`gpucloud job`: submit, watch and cancel jobs on the control plane."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli.login import client
from gpucloud.cli.output import JsonFlag, console, emit, err_console, human_seconds, table
from gpucloud.durations import format_duration

app = typer.Typer(
    help="Jobs: commands or training runs on the cluster's GPUs.", no_args_is_help=True
)
JobId = Annotated[int, typer.Argument(min=1, help="Job id (see gpucloud job list).")]


def _age(job: dict) -> str:
    """How long its last run lasted (or lasts so far), and of what time limit."""
    end = job["finished_at"] or time.time()
    start = job["started_at"]
    ran = human_seconds(end - start) if start else "-"
    limit = job.get("time_limit")
    return f"{ran} of {format_duration(limit)}" if limit else ran


def _render_list(rows: list[dict]) -> None:
    console.print(
        table(
            "Jobs",
            ["id", "name", "state", "gpus", "node/devices", "attempts", "ran", "reason"],
            [
                (
                    j["id"],
                    j["name"],
                    j["state"],
                    f"{j['gpus']} x {j['gpu_type'] or 'any'}",
                    f"{j['node']} {j['devices']}" if j["node"] else "-",
                    j["attempts"],
                    _age(j),
                    "; ".join(x for x in (j["reason"], j.get("idle")) if x),
                )
                for j in rows
            ],
        )
    )


def _render_one(j: dict) -> None:
    _render_list([j])
    console.print(
        table(
            f"job {j['id']} events",
            ["at", "from", "to", "reason"],
            [
                (
                    time.strftime("%H:%M:%S", time.localtime(e["at"])),
                    e["from_state"] or "-",
                    e["to_state"],
                    e["reason"] or "",
                )
                for e in j["events"]
            ],
        )
    )


@app.command("submit")
def submit(
    spec: Annotated[str, typer.Argument(help="Job spec file (YAML or TOML).")],
    no_upload: Annotated[
        bool,
        typer.Option(
            "--no-upload",
            help="Do not upload the workdir: it (and every path in SPEC) names a dir on the "
            "control plane's machine, in your tenant's area (relative paths start there) or a "
            "dir the admin exported.",
        ),
    ] = False,
    interactive: Annotated[
        bool,
        typer.Option(
            "--interactive",
            help="A notebook or dev box: stopped (SIGTERM) once its accelerators sit idle for "
            "its idle TTL.",
        ),
    ] = False,
    idle_ttl: Annotated[
        str | None,
        typer.Option(help="With --interactive: idle time before it is stopped, e.g. 30m."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Submit the job in SPEC: name, command (or train: CONFIG), gpus, and optionally
    gpu_type, cpus and memory_gib (host resources for the whole job), priority,
    preemptible, max_retries, env, checkpoint_dir, workdir, time_limit (how long each run
    may last, e.g. 45m or 12h: then SIGTERM, SIGKILL after the grace period, and FAILED),
    labels, interactive and idle_ttl (the flags below override the last two).

    The workdir (default: the current directory) is uploaded into your tenant's area, as
    SkyPilot syncs a workdir, and the job runs in that copy as your tenant's OS user; paths
    of SPEC inside it (relative ones start from the current directory) point into the copy.
    `.git`, `.venv`, caches and the patterns in its `.gpucloudignore` are left out."""
    from gpucloud.cli.upload import into_upload, upload
    from gpucloud.control import specfile
    from gpucloud.control.schemas import JobSpec

    overrides = {"interactive": interactive or None, "idle_ttl": idle_ttl}
    body = specfile.load(spec, JobSpec, overrides).model_dump(exclude_none=True)
    c = client()
    if not no_upload:
        local = Path(os.path.abspath(body.get("workdir", ".")))
        remote = upload(c, local)
        body["workdir"] = remote
        for key in ("train", "checkpoint_dir"):
            if key in body:
                body[key] = into_upload(body[key], local, remote)
    job = c.post("/jobs", body)
    for warning in job.get("warnings", []):  # on stderr: --json output stays one document
        err_console.print(f"warning: {warning}", highlight=False, markup=False, soft_wrap=True)
    emit(
        job,
        as_json,
        lambda j: console.print(
            f"job {j['id']} ({j['name']}) submitted: {j['state']}", highlight=False
        ),
    )


@app.command("list")
def list_(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Your tenant's jobs, newest first."""
    emit(client().get("/jobs", state=state.upper() if state else None), as_json, _render_list)


@app.command("get")
def get(job_id: JobId, as_json: JsonFlag = False) -> None:
    """One job with its event history."""
    emit(client().get(f"/jobs/{job_id}"), as_json, _render_one)


@app.command("logs")
def logs(
    job_id: JobId,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Stream until it ends.")] = False,
) -> None:
    """The job's output, every attempt's in order."""
    c = client()
    if not follow:
        sys.stdout.write(c.get(f"/jobs/{job_id}/logs"))
        return
    for chunk in c.stream(f"/jobs/{job_id}/logs", follow="true"):
        sys.stdout.write(chunk)
        sys.stdout.flush()


@app.command("cancel")
def cancel(job_id: JobId, as_json: JsonFlag = False) -> None:
    """Cancel a job: a running one gets SIGTERM, then SIGKILL after the grace period."""
    emit(
        client().post(f"/jobs/{job_id}/cancel"),
        as_json,
        lambda j: console.print(
            f"job {j['id']}: {'cancelling' if j['state'] == 'RUNNING' else j['state']}",
            highlight=False,
        ),
    )
