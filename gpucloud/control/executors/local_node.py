"""This machine as a node of the local executor: its accelerators (detected, or virtual
CPU slots) and the CPU and memory it offers to workloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil

from gpucloud import hardware
from gpucloud.control.config import Settings
from gpucloud.control.executors.base import NodeInfo
from gpucloud.errors import ConfigError


def host_resources(settings: Settings) -> tuple[int, int]:
    """The millicores and MiB this node offers: the settings', else what the machine has."""
    cpus = settings.node_cpus
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = settings.node_memory_gib
    if memory is None:
        memory = psutil.virtual_memory().total / 2**30
    if cpus <= 0 or memory <= 0:
        raise ConfigError(f"a node needs CPUs and memory > 0, got {cpus:g} and {memory:g} GiB")
    # whole MiB, rounded down: a node must not offer more than it has
    return int(cpus * 1000), int(memory * 1024)


def local_node(settings: Settings) -> NodeInfo:
    """This machine as a node, with what it offers to workloads."""
    gpu_type, gpus, backend, labels = _accelerators(settings)
    cpu_milli, memory_mib = host_resources(settings)
    return NodeInfo(
        settings.node_name, gpu_type, gpus, backend, "127.0.0.1", cpu_milli, memory_mib, labels
    )


def _accelerators(settings: Settings) -> tuple[str, int, str, dict[str, str]]:
    """This machine's accelerators (type, count, backend, labels), or `--virtual-gpus` CPU
    slots of `settings.gpu_type`.

    Detection runs `gpucloud hardware local` in a child process: the control plane itself
    never imports torch. Raises ConfigError when there is nothing to schedule on.
    """
    if settings.virtual_gpus is not None:
        if settings.virtual_gpus < 1:
            raise ConfigError(f"--virtual-gpus must be >= 1, got {settings.virtual_gpus}")
        gpu_type = hardware.get(settings.gpu_type).name
        return gpu_type, settings.virtual_gpus, "cpu", {"virtual": "true"}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from gpucloud.cli.main import app; app()",
            "hardware",
            "local",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise ConfigError(f"could not detect accelerators: {out.stderr.strip()[-500:]}")
    info = json.loads(out.stdout)
    if info["backend"] == "cpu":
        raise ConfigError(
            "no accelerators found on this machine: pass --virtual-gpus N to "
            "declare N CPU slots for trying the platform"
        )
    name = info["devices"][0]["name"]
    return (
        catalog_type(name, settings.gpu_type),
        len(info["devices"]),
        info["backend"],
        {"device": name},
    )


def catalog_type(device_name: str, fallback: str) -> str:
    """The catalog type a device reports itself as (e.g. 'NVIDIA H100 80GB HBM3')."""
    norm = device_name.upper().replace(" ", "-")
    matches = [a.name for a in hardware.all_accelerators() if a.name.upper() in norm]
    if not matches:
        short = [
            a.name for a in hardware.all_accelerators() if a.name.split("-")[0].upper() in norm
        ]
        matches = short
    return max(matches, key=len) if matches else hardware.get(fallback).name
