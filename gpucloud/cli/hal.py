"""`gpucloud hal`: what the hardware abstraction layer picks on this machine."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from gpucloud.cli.output import JsonFlag, console, emit, table

app = typer.Typer(help="Hardware abstraction: the ops each backend runs.", no_args_is_help=True)


@app.command("ops")
def ops_(
    backend: Annotated[
        str | None, typer.Option("--backend", help="Only this backend (cpu, cuda, npu, ...).")
    ] = None,
    op: Annotated[str | None, typer.Option("--op", help="Only this op.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Per op, the implementation each backend uses: its first one this machine can run,
    else the reference; the ones it cannot run here are named with it."""
    from gpucloud.errors import unknown_name
    from gpucloud.hal import device, ops

    if backend is not None and backend not in device.BACKENDS:
        raise unknown_name("backend", backend, device.BACKENDS)
    if op is not None and op not in ops.op_names():
        raise unknown_name("op", op, ops.op_names())
    present = device.available()
    data = {
        "backends": {
            name: {
                "present": name in present,
                "ops": {
                    o: {
                        "uses": ops.choose(o, name).name,
                        "candidates": [
                            {"name": i.name, "available": i.available()}
                            for i in ops.implementations(o, name)
                        ],
                    }
                    for o in ([op] if op else ops.op_names())
                },
            }
            for name in ([backend] if backend else device.BACKENDS)
        }
    }
    emit(data, as_json, _render)


def _render(d: dict[str, Any]) -> None:
    backends = d["backends"]
    columns = ["op"] + [b + ("" if v["present"] else " (absent)") for b, v in backends.items()]
    ops = next(iter(backends.values()))["ops"]
    rows = [[op] + [_cell(v["ops"][op]) for v in backends.values()] for op in ops]
    title = "Op implementations per backend"
    console.print(table(title, columns, rows), highlight=False)


def _cell(choice: dict[str, Any]) -> str:
    missing = [c["name"] for c in choice["candidates"] if not c["available"]]
    return choice["uses"] + (f" (not here: {', '.join(missing)})" if missing else "")


@app.command("telemetry")
def telemetry_(
    source: Annotated[
        str,
        typer.Option(
            "--source",
            help="auto, nvml, npu-smi, none or recorded:PATH (a JSON-lines recording).",
        ),
    ] = "auto",
    as_json: JsonFlag = False,
) -> None:
    """Each device's utilisation, memory, temperature, power, ECC and Xid errors, and the
    fatal errors that would take this node out of service. `--json` prints one line of a
    recording: append it to a file for `--source recorded:FILE` or `gpucloud server
    --telemetry recorded:FILE`."""
    import json

    from gpucloud.hal.telemetry import Monitor, open_source, snapshot_json

    monitor = Monitor(open_source(source))
    samples = monitor.latest()
    snapshot = json.loads(snapshot_json(samples))
    snapshot["fatal"] = monitor.fatal()
    if as_json:
        print(json.dumps(snapshot))
        return
    _render_telemetry(monitor.source.name, snapshot)


def _render_telemetry(source: str, snapshot: dict[str, Any]) -> None:
    if not snapshot["devices"]:
        console.print(f"no device reports telemetry through {source}", highlight=False)
        return
    gib = 1 << 30
    rows = [
        [
            str(d["index"]),
            d["name"],
            _figure(d["utilization"], "{:.0f}%"),
            f"{d['memory_used_bytes'] / gib:.1f} / {d['memory_total_bytes'] / gib:.1f} GiB"
            if d["memory_total_bytes"]
            else "-",
            _figure(d["temperature_c"], "{:.0f} C"),
            _figure(d["power_w"], "{:.0f} W"),
            f"{_figure(d['ecc_corrected'], '{}')} / {_figure(d['ecc_uncorrected'], '{}')}",
            ", ".join(map(str, d["xid_errors"])) or "-",
        ]
        for d in snapshot["devices"]
    ]
    columns = ["gpu", "name", "util", "memory", "temp", "power", "ECC corr / uncorr", "Xid"]
    console.print(table(f"Telemetry ({source})", columns, rows), highlight=False)
    for reason in snapshot["fatal"]:
        console.print(f"[red]FATAL[/] {reason}", highlight=False)
    if not snapshot["fatal"]:
        console.print("[green]healthy[/]: no fatal device error", highlight=False)


def _figure(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)
