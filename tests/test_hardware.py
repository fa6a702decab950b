import pytest

from gpucloud import hardware
from gpucloud.errors import ConfigError, NotFoundError

REQUIRED = ["A10", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200",
            "B200", "RTX-4090", "MI300X", "Ascend-910B"]  # fmt: skip


def test_catalog_has_every_required_type_with_sane_figures():
    for name in REQUIRED:
        acc = hardware.get(name)
        assert acc.memory_bytes > 16 * 2**30
        assert acc.fp8_flops >= acc.bf16_flops > 50e12
        assert acc.memory_bandwidth > 2e11 and acc.link_bandwidth > 0
        assert acc.price_per_hour > 0


def test_lookup_is_forgiving_and_errors_name_the_closest():
    assert hardware.get("h100").name == "H100-SXM"
    assert hardware.get("a100_80gb").name == "A100-80GB"
    assert hardware.get("910B").name == "Ascend-910B"
    with pytest.raises(NotFoundError, match="H100-SXM"):
        hardware.get("H100-SMX")


def test_prices_are_overridden_from_a_file(tmp_path, monkeypatch):
    prices = tmp_path / "prices.toml"
    prices.write_text('"H100-SXM" = 1.99\nL4 = 0.5\n')
    monkeypatch.setenv("GPUCLOUD_PRICES", str(prices))
    assert hardware.get("H100-SXM").price_per_hour == 1.99
    assert hardware.get("L4").price_per_hour == 0.5
    assert hardware.get("A10").price_per_hour == 0.75
    prices.write_text("H100-SXM = -1\n")
    with pytest.raises(ConfigError, match="positive"):
        hardware.get("A10")
    prices.write_text("H999 = 1\n")
    with pytest.raises(NotFoundError, match="unknown GPU type"):
        hardware.get("A10")
