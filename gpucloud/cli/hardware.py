"""`gpucloud hardware`: the accelerator catalog and what this machine has."""

from __future__ import annotations

from dataclasses import asdict

import typer

from gpucloud.cli.output import JsonFlag, console, emit, human_bytes, table

app = typer.Typer(help="Accelerator catalog and local devices.", no_args_is_help=True)


@app.command("list")
def list_(as_json: JsonFlag = False) -> None:
    """The accelerator catalog: memory, dense TFLOP/s, bandwidth, links and price."""
    from gpucloud import hardware

    rows = [asdict(a) for a in hardware.all_accelerators()]
    emit(
        rows,
        as_json,
        lambda rows: console.print(
            table(
                "Accelerator catalog (dense peaks)",
                ["name", "memory", "bf16 TFLOP/s", "fp8/int8", "HBM GB/s", "link", "$/GPU-h"],
                [
                    (
                        r["name"],
                        human_bytes(r["memory_bytes"]),
                        f"{r['bf16_flops'] / 1e12:g}",
                        f"{r['fp8_flops'] / 1e12:g}",
                        f"{r['memory_bandwidth'] / 1e9:g}",
                        f"{r['link']} {r['link_bandwidth'] / 1e9:g} GB/s",
                        f"{r['price_per_hour']:.2f}",
                    )
                    for r in rows
                ],  # fmt: skip
            )
        ),
    )


@app.command("local")
def local(as_json: JsonFlag = False) -> None:
    """The backend torch uses on this machine, its devices and the collective backend."""
    from gpucloud.hal import device

    backend = device.detect()
    devs = [asdict(d) for d in device.devices(backend)]
    data = {"backend": backend.name, "dist_backend": backend.dist_backend, "devices": devs}
    emit(
        data,
        as_json,
        lambda d: console.print(
            table(
                f"backend {d['backend']} (collectives: {d['dist_backend']})",
                ["device", "name", "total", "free"],
                [
                    (
                        x["index"],
                        x["name"],
                        human_bytes(x["total_bytes"]),
                        human_bytes(x["free_bytes"]),
                    )
                    for x in d["devices"]
                ],  # fmt: skip
            )
        ),
    )
