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


DOMESTIC = {"K100-AI": "hygon", "Z100L": "hygon", "MLU370-X8": "cambricon",
            "MLU590": "cambricon"}  # fmt: skip


def test_hygon_dcu_and_cambricon_mlu_are_in_the_catalog():
    for name, vendor in DOMESTIC.items():
        acc = hardware.get(name)
        assert acc.vendor == vendor and not acc.has_fp8
        assert acc.memory_bytes >= 32 * 10**9 and acc.memory_bandwidth >= 600 * 10**9
        assert acc.int8_ops >= acc.bf16_flops > 20e12 and acc.price_per_hour > 0
    mlu = hardware.get("MLU370-X8")  # an MLU-Link bridge joins 4 of a server's 8 cards
    assert (mlu.link, mlu.gpus_per_node, mlu.link_domain) == ("MLU-Link", 8, 4)
    assert hardware.names()[-4:] == list(DOMESTIC)


def test_domestic_names_as_people_type_them_and_typos():
    for typed, name in (("k100", "K100-AI"), ("k100_ai", "K100-AI"), ("DCU-K100", "K100-AI"),
                        ("dcu z100l", "Z100L"), ("mlu370", "MLU370-X8"),
                        ("MLU-370-X8", "MLU370-X8"), ("mlu-590", "MLU590")):  # fmt: skip
        assert hardware.get(typed).name == name, typed
    with pytest.raises(NotFoundError, match="did you mean MLU590"):
        hardware.get("MLU509")
    with pytest.raises(NotFoundError, match="did you mean K100-AI"):
        hardware.get("K10O-AI")


def test_hardware_list_shows_the_domestic_types(capsys, monkeypatch):
    import json
    import sys

    from gpucloud.cli import main

    monkeypatch.setattr(sys, "argv", ["gpucloud", "hardware", "list", "--json"])
    with pytest.raises(SystemExit) as done:
        main.app()
    assert not done.value.code
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {n: rows[n]["vendor"] for n in DOMESTIC} == DOMESTIC
    assert rows["MLU370-X8"]["memory_bandwidth"] == 614.4e9
