"""Catalog of accelerator types: memory, peak dense throughput, bandwidth, links, price.

Figures are the vendors' published peaks for *dense* math (no 2:4 sparsity), in bytes,
bytes/s and FLOP/s. Prices are representative on-demand cloud prices per GPU-hour in USD
(late 2025 neocloud list prices); a user overrides them from a file because every
contract differs (`load_prices` / `GPUCLOUD_PRICES`).
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from gpucloud.errors import ConfigError, unknown_name

GB = 10**9
Gbit = 10**9 / 8  # network links are quoted in bits per second
GiB = 2**30
TB = 10**12
TFLOPS = 10**12


@dataclass(frozen=True, slots=True)
class Accelerator:
    """One accelerator type. `memory_bytes` is what the device reports as usable HBM/GDDR."""

    name: str
    vendor: str  # nvidia | amd | huawei | hygon | cambricon
    memory_bytes: int
    bf16_flops: float  # dense bf16/fp16 tensor-core peak
    fp8_flops: float  # dense fp8 peak, or int8 TOPS where the part has no fp8
    int8_ops: float
    memory_bandwidth: float  # bytes/s
    link: str  # intra-node interconnect: NVLink | Infinity Fabric | HCCS | MLU-Link | PCIe
    link_bandwidth: float  # bytes/s per GPU, bidirectional aggregate as vendors quote it
    gpus_per_node: int  # usual server size
    link_domain: int  # GPUs that share the fast link in one server (1 = PCIe only)
    node_network_bandwidth: float  # bytes/s one way, the server's NICs together (inter-node)
    price_per_hour: float  # USD per GPU-hour
    has_fp8: bool = True

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB


def _acc(**kw) -> Accelerator:
    return Accelerator(**kw)


# link_bandwidth is the bidirectional aggregate per GPU as vendors quote it (NVLink 900 GB/s
# on H100 = 450 GB/s each way). The planner halves it for a ring all-reduce estimate.
# node_network_bandwidth is a representative server's NICs together, one way (what a ring
# crossing nodes gets): 8 x 400 Gb/s on HGX-class servers, one or two Ethernet ports on
# consumer- and PCIe-card servers. Vendors publish reference designs, not a fixed figure.
_CATALOG: dict[str, Accelerator] = {
    a.name: a
    for a in [
        # NVIDIA A10 datasheet: 24 GB GDDR6, 600 GB/s, BF16 tensor 125 TFLOPS (250 sparse),
        # INT8 250 TOPS (500 sparse), PCIe Gen4 x16 64 GB/s.
        _acc(
            name="A10",
            vendor="nvidia",
            memory_bytes=24 * GiB,
            bf16_flops=125 * TFLOPS,
            fp8_flops=250 * TFLOPS,
            int8_ops=250 * TFLOPS,
            memory_bandwidth=600 * GB,
            link="PCIe",
            link_bandwidth=64 * GB,
            gpus_per_node=4,
            link_domain=1,
            node_network_bandwidth=100 * Gbit,  # one 100 GbE port per server
            price_per_hour=0.75,
            has_fp8=False,
        ),
        # NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, BF16 121 TFLOPS (242 sparse),
        # FP8 242.5 TFLOPS (485 sparse), INT8 242.5 TOPS, PCIe Gen4 x16 64 GB/s.
        _acc(
            name="L4",
            vendor="nvidia",
            memory_bytes=24 * GiB,
            bf16_flops=121 * TFLOPS,
            fp8_flops=242.5 * TFLOPS,
            int8_ops=242.5 * TFLOPS,
            memory_bandwidth=300 * GB,
            link="PCIe",
            link_bandwidth=64 * GB,
            gpus_per_node=8,
            link_domain=1,
            node_network_bandwidth=100 * Gbit,  # one 100 GbE port per server
            price_per_hour=0.70,
        ),
        # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, BF16 362.05 TFLOPS (733 sparse),
        # FP8 733 TFLOPS (1,466 sparse), INT8 733 TOPS, PCIe Gen4 x16 64 GB/s.
        _acc(
            name="L40S",
            vendor="nvidia",
            memory_bytes=48 * GiB,
            bf16_flops=362 * TFLOPS,
            fp8_flops=733 * TFLOPS,
            int8_ops=733 * TFLOPS,
            memory_bandwidth=864 * GB,
            link="PCIe",
            link_bandwidth=64 * GB,
            gpus_per_node=8,
            link_domain=1,
            node_network_bandwidth=400 * Gbit,  # L40S server design: 400 Gb/s per server
            price_per_hour=1.50,
        ),
        # NVIDIA A100 datasheet (SXM4 40GB): HBM2 1,555 GB/s, BF16 312 TFLOPS (624 sparse),
        # INT8 624 TOPS, NVLink 3 600 GB/s. No FP8.
        _acc(
            name="A100-40GB",
            vendor="nvidia",
            memory_bytes=40 * GiB,
            bf16_flops=312 * TFLOPS,
            fp8_flops=624 * TFLOPS,
            int8_ops=624 * TFLOPS,
            memory_bandwidth=1555 * GB,
            link="NVLink",
            link_bandwidth=600 * GB,
            gpus_per_node=8,
            link_domain=8,
            node_network_bandwidth=8 * 200 * Gbit,  # HGX A100: a 200 Gb/s HDR NIC per GPU
            price_per_hour=1.30,
            has_fp8=False,
        ),
        # NVIDIA A100 datasheet (SXM4 80GB): HBM2e 2,039 GB/s, BF16 312 TFLOPS, INT8 624 TOPS,
        # NVLink 3 600 GB/s. No FP8.
        _acc(
            name="A100-80GB",
            vendor="nvidia",
            memory_bytes=80 * GiB,
            bf16_flops=312 * TFLOPS,
            fp8_flops=624 * TFLOPS,
            int8_ops=624 * TFLOPS,
            memory_bandwidth=2039 * GB,
            link="NVLink",
            link_bandwidth=600 * GB,
            gpus_per_node=8,
            link_domain=8,
            node_network_bandwidth=8 * 200 * Gbit,  # HGX A100: a 200 Gb/s HDR NIC per GPU
            price_per_hour=1.80,
            has_fp8=False,
        ),
        # NVIDIA H100 datasheet (SXM5): 80 GB HBM3 3.35 TB/s, BF16 989 TFLOPS (1,979 sparse),
        # FP8 1,979 TFLOPS (3,958 sparse), INT8 1,979 TOPS, NVLink 4 900 GB/s.
        _acc(
            name="H100-SXM",
            vendor="nvidia",
            memory_bytes=80 * GiB,
            bf16_flops=989 * TFLOPS,
            fp8_flops=1979 * TFLOPS,
            int8_ops=1979 * TFLOPS,
            memory_bandwidth=3350 * GB,
            link="NVLink",
            link_bandwidth=900 * GB,
            gpus_per_node=8,
            link_domain=8,
            node_network_bandwidth=8 * 400 * Gbit,  # HGX H100: a 400 Gb/s NDR NIC per GPU
            price_per_hour=2.50,
        ),
        # NVIDIA H100 datasheet (PCIe): 80 GB HBM2e 2 TB/s, BF16 756 TFLOPS (1,513 sparse),
        # FP8 1,513 TFLOPS, INT8 1,513 TOPS, PCIe Gen5 128 GB/s (NVLink bridge pairs aside).
        _acc(
            name="H100-PCIe",
            vendor="nvidia",
            memory_bytes=80 * GiB,
            bf16_flops=756 * TFLOPS,
            fp8_flops=1513 * TFLOPS,
            int8_ops=1513 * TFLOPS,
            memory_bandwidth=2000 * GB,
            link="PCIe",
            link_bandwidth=128 * GB,
            gpus_per_node=8,
            link_domain=1,
            node_network_bandwidth=400 * Gbit,  # PCIe servers: 2 x 200 Gb/s
            price_per_hour=2.20,
        ),
        # NVIDIA H200 datasheet (SXM): 141 GB HBM3e 4.8 TB/s, BF16 989 TFLOPS, FP8 1,979 TFLOPS,
        # INT8 1,979 TOPS, NVLink 4 900 GB/s.
        _acc(
            name="H200",
            vendor="nvidia",
            memory_bytes=141 * GB,
            bf16_flops=989 * TFLOPS,
            fp8_flops=1979 * TFLOPS,
            int8_ops=1979 * TFLOPS,
            memory_bandwidth=4800 * GB,
            link="NVLink",
            link_bandwidth=900 * GB,
            gpus_per_node=8,
            link_domain=8,
            node_network_bandwidth=8 * 400 * Gbit,  # HGX H200: a 400 Gb/s NDR NIC per GPU
            price_per_hour=3.50,
        ),
        # NVIDIA HGX B200 datasheet, per GPU: 180 GB HBM3e 7.7 TB/s, BF16 2.25 PFLOPS dense
        # (4.5 sparse), FP8 4.5 PFLOPS dense, INT8 4.5 POPS dense, NVLink 5 1.8 TB/s.
        _acc(
            name="B200",
            vendor="nvidia",
            memory_bytes=180 * GB,
            bf16_flops=2250 * TFLOPS,
            fp8_flops=4500 * TFLOPS,
            int8_ops=4500 * TFLOPS,
            memory_bandwidth=7700 * GB,
            link="NVLink",
            link_bandwidth=1800 * GB,
            gpus_per_node=8,
            link_domain=8,
            node_network_bandwidth=8 * 400 * Gbit,  # HGX B200: a 400 Gb/s NIC per GPU
            price_per_hour=5.00,
        ),
        # NVIDIA Ada Lovelace whitepaper (GeForce RTX 4090): 24 GB GDDR6X 1,008 GB/s,
        # BF16 tensor with FP32 accumulate 165.2 TFLOPS, FP8 (FP32 acc.) 330.3 TFLOPS,
        # INT8 660.6 TOPS, no NVLink: PCIe Gen4 x16 64 GB/s.
        _acc(
            name="RTX-4090",
            vendor="nvidia",
            memory_bytes=24 * GiB,
            bf16_flops=165.2 * TFLOPS,
            fp8_flops=330.3 * TFLOPS,
            int8_ops=660.6 * TFLOPS,
            memory_bandwidth=1008 * GB,
            link="PCIe",
            link_bandwidth=64 * GB,
            gpus_per_node=8,
            link_domain=1,
            node_network_bandwidth=50 * Gbit,  # GeForce servers: 2 x 25 GbE, no GPUDirect RDMA
            price_per_hour=0.40,
        ),
        # AMD Instinct MI300X datasheet: 192 GB HBM3 5.3 TB/s, BF16 1,307.4 TFLOPS dense,
        # FP8 2,614.9 TFLOPS dense, INT8 2,614.9 TOPS, Infinity Fabric 7 x 128 GB/s = 896 GB/s.
        _acc(
            name="MI300X",
            vendor="amd",
            memory_bytes=192 * GB,
            bf16_flops=1307.4 * TFLOPS,
            fp8_flops=2614.9 * TFLOPS,
            int8_ops=2614.9 * TFLOPS,
            memory_bandwidth=5300 * GB,
            link="Infinity Fabric",
            link_bandwidth=896 * GB,
            gpus_per_node=8,
            link_domain=8,
            node_network_bandwidth=8 * 400 * Gbit,  # MI300X platform: a 400 Gb/s NIC per GPU
            price_per_hour=2.50,
        ),
        # Huawei Ascend 910B (Atlas 800T A2 datasheet and Huawei's published 910B figures):
        # 64 GB HBM2e ~1.6 TB/s, FP16/BF16 ~313 TFLOPS (910B3 bin), INT8 ~640 TOPS,
        # HCCS 7 links x 56 GB/s = 392 GB/s in an 8-NPU server. No FP8.
        _acc(
            name="Ascend-910B",
            vendor="huawei",
            memory_bytes=64 * GB,
            bf16_flops=313 * TFLOPS,
            fp8_flops=640 * TFLOPS,
            int8_ops=640 * TFLOPS,
            memory_bandwidth=1600 * GB,
            link="HCCS",
            link_bandwidth=392 * GB,
            gpus_per_node=8,
            link_domain=8,
            node_network_bandwidth=8 * 200 * Gbit,  # Atlas 800T A2: 8 x 200GE RoCE ports
            price_per_hour=1.20,
            has_fp8=False,
        ),
        # Hygon DCU K100-AI ("Shensuan-2", 2024): Hygon publishes no English datasheet; the
        # figures are from Hygon's and Sugon's Chinese product announcements: 64 GB HBM2e,
        # 896 GB/s, FP16/BF16 ~196 TFLOPS, INT8 ~392 TOPS, PCIe Gen4 x16 card. Hygon's
        # inter-card link (xHCL) bandwidth is not public: PCIe Gen4 64 GB/s, no fast link domain,
        # is the conservative choice. No FP8. Price: no public USD price; set relative to the
        # Ascend-910B here (override with GPUCLOUD_PRICES).
        _acc(
            name="K100-AI",
            vendor="hygon",
            memory_bytes=64 * GB,
            bf16_flops=196 * TFLOPS,
            fp8_flops=392 * TFLOPS,
            int8_ops=392 * TFLOPS,
            memory_bandwidth=896 * GB,
            link="PCIe",
            link_bandwidth=64 * GB,
            gpus_per_node=8,
            link_domain=1,
            node_network_bandwidth=200 * Gbit,  # PCIe servers: 200 Gb/s (conservative)
            price_per_hour=0.90,
            has_fp8=False,
        ),
        # Hygon DCU Z100L ("Shensuan-1" family, AMD gfx906-derived): Sugon's product page gives
        # 32 GB HBM2 at 1 TB/s on a PCIe Gen4 x16 card. Its FP16 peak is not published and the
        # part has no matrix cores: the conservative 24 TFLOPS FP16 (= 2x its ~12 TFLOPS FP32
        # vector rate, as packed FP16 on gfx906 gives) and 2x that in INT8 (dot4) are our
        # estimate, not a vendor figure. No FP8, no BF16 hardware (bf16 runs at that rate at
        # best). Price: an estimate (override with GPUCLOUD_PRICES).
        _acc(
            name="Z100L",
            vendor="hygon",
            memory_bytes=32 * GB,
            bf16_flops=24 * TFLOPS,
            fp8_flops=48 * TFLOPS,
            int8_ops=48 * TFLOPS,
            memory_bandwidth=1000 * GB,
            link="PCIe",
            link_bandwidth=64 * GB,
            gpus_per_node=8,
            link_domain=1,
            node_network_bandwidth=100 * Gbit,  # PCIe servers: 100 GbE (conservative)
            price_per_hour=0.35,
            has_fp8=False,
        ),
        # Cambricon MLU370-X8 product page (two Siyuan 370 chips on one card, seen as one
        # device): 48 GB LPDDR5 614.4 GB/s, FP16/BF16 96 TFLOPS, INT8 256 TOPS, PCIe Gen4 x16;
        # an MLU-Link bridge joins 4 cards, 200 GB/s bidirectional per card, so an 8-card server
        # is two 4-card link domains. No FP8. Price: no public USD price; an estimate close to
        # a consumer-class card here (override with GPUCLOUD_PRICES).
        _acc(
            name="MLU370-X8",
            vendor="cambricon",
            memory_bytes=48 * GB,
            bf16_flops=96 * TFLOPS,
            fp8_flops=256 * TFLOPS,
            int8_ops=256 * TFLOPS,
            memory_bandwidth=614.4 * GB,
            link="MLU-Link",
            link_bandwidth=200 * GB,
            gpus_per_node=8,
            link_domain=4,
            node_network_bandwidth=200 * Gbit,  # PCIe servers: 200 Gb/s (conservative)
            price_per_hour=0.60,
            has_fp8=False,
        ),
        # Cambricon MLU590 (Siyuan 590, OAM module): Cambricon publishes no datasheet. Press
        # reports put it near an A100 (80 GB HBM2e, ~2.7 TB/s, FP16 ~314 TFLOPS); those are not
        # vendor figures, so the catalog takes conservative ones: 64 GB, 1.6 TB/s, BF16 256
        # TFLOPS, INT8 512 TOPS, MLU-Link 400 GB/s across the 8 modules of an OAM server.
        # No FP8 is documented. Price: an estimate (override with GPUCLOUD_PRICES).
        _acc(
            name="MLU590",
            vendor="cambricon",
            memory_bytes=64 * GB,
            bf16_flops=256 * TFLOPS,
            fp8_flops=512 * TFLOPS,
            int8_ops=512 * TFLOPS,
            memory_bandwidth=1600 * GB,
            link="MLU-Link",
            link_bandwidth=400 * GB,
            gpus_per_node=8,
            link_domain=8,
            node_network_bandwidth=8 * 100 * Gbit,  # 100 Gb/s per module (conservative)
            price_per_hour=1.10,
            has_fp8=False,
        ),
    ]
}

# Names people commonly type, mapped to the catalog's.
_ALIASES = {
    "A100": "A100-80GB",
    "H100": "H100-SXM",
    "RTX4090": "RTX-4090",
    "4090": "RTX-4090",
    "910B": "Ascend-910B",
    "ASCEND910B": "Ascend-910B",
    "K100": "K100-AI",
    "DCUK100": "K100-AI",
    "HYGONK100": "K100-AI",
    "DCUZ100L": "Z100L",
    "HYGONZ100L": "Z100L",
    "MLU370": "MLU370-X8",
    "590": "MLU590",
}


def _normalize(name: str) -> str:
    return name.upper().replace("_", "-").replace(" ", "-")


def names() -> list[str]:
    """Every accelerator name in the catalog, in catalog order."""
    return list(_catalog())


def get(name: str) -> Accelerator:
    """The accelerator called `name` (case-insensitive, common aliases accepted).

    Raises NotFoundError naming the closest catalog entries.
    """
    return _catalog()[_resolve(name)]


def _resolve(name: str) -> str:
    by_flat = {_normalize(n).replace("-", ""): n for n in _CATALOG}
    key = _normalize(name)
    flat = key.replace("-", "")
    found = by_flat.get(flat) or _ALIASES.get(flat) or _ALIASES.get(key)
    if found is None:
        raise unknown_name("GPU type", name, _CATALOG)
    return found


def all_accelerators() -> list[Accelerator]:
    return list(_catalog().values())


def load_prices(path: str | os.PathLike) -> dict[str, float]:
    """Read a price file: `{"H100-SXM": 2.10, ...}` as JSON, or `H100-SXM = 2.10` lines as TOML.

    Raises ConfigError for an unreadable file, an unknown GPU name or a non-positive price.
    """
    p = Path(path)
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read price file {p}: {e}") from None
    prices: dict[str, float] = {}
    for name, price in data.items():
        canonical = _resolve(name)
        if not isinstance(price, int | float) or isinstance(price, bool) or price <= 0:
            raise ConfigError(
                f"price for {name} in {p} must be a positive number of USD per GPU-hour"
            )
        prices[canonical] = float(price)
    return prices


def _catalog() -> dict[str, Accelerator]:
    """The built-in catalog, with prices overridden from $GPUCLOUD_PRICES when it is set."""
    path = os.environ.get("GPUCLOUD_PRICES")
    if not path:
        return _CATALOG
    prices = load_prices(path)
    return {
        n: replace(a, price_per_hour=prices.get(n, a.price_per_hour)) for n, a in _CATALOG.items()
    }
