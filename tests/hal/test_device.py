import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpucloud.errors import NotFoundError, UserError
from gpucloud.hal import device, ops

EXAMPLES = Path(__file__).parents[2] / "examples" / "train"


def test_cpu_machine_detects_cpu_and_gloo():
    backend = device.detect()
    assert backend.name == "cpu" and backend.dist_backend == "gloo"
    info = device.memory_info()
    assert info.total_bytes > info.free_bytes > 0


def test_every_backend_names_its_collectives_and_pinning_variable():
    assert device.BACKENDS["cuda"].dist_backend == "nccl"
    assert device.BACKENDS["npu"].dist_backend == "hccl"
    assert device.BACKENDS["xpu"].dist_backend == "xccl"
    assert device.visible_devices_env([2, 3], "cuda") == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert device.visible_devices_env([0], "npu") == {"ASCEND_RT_VISIBLE_DEVICES": "0"}
    assert device.visible_devices_env([0], "cpu") == {}
    with pytest.raises(NotFoundError, match="cuda"):
        device.get_backend("cdua")


def test_a_share_of_a_device_is_a_memory_cap_and_on_nvidia_an_mps_percentage(monkeypatch):
    assert device.shared_device_env(0.25, "cuda") == {
        "GPUCLOUD_GPU_MEMORY_FRACTION": "0.25",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
    }
    assert device.shared_device_env(0.5, "cpu") == {"GPUCLOUD_GPU_MEMORY_FRACTION": "0.5"}
    monkeypatch.delenv("GPUCLOUD_GPU_MEMORY_FRACTION", raising=False)
    assert device.memory_share() is None
    monkeypatch.setenv("GPUCLOUD_GPU_MEMORY_FRACTION", "0.5")
    assert device.memory_share() == 0.5
    for bad in ("1.5", "half", "0"):
        monkeypatch.setenv("GPUCLOUD_GPU_MEMORY_FRACTION", bad)
        with pytest.raises(UserError, match=f"GPUCLOUD_GPU_MEMORY_FRACTION={bad}: give a number"):
            device.memory_share()


def test_device_module_does_not_import_torch():
    # The control plane pins devices through hal but must never import torch.
    code = "import sys, gpucloud.hal.device; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ)


def test_op_registry_falls_back_to_reference_and_prefers_backend_impl():
    @ops.register("rms_norm", backend="test-backend")
    def fake(x, w, eps):
        return x

    assert ops.get("rms_norm", "cpu") is ops.rms_norm
    assert ops.get("rms_norm", "test-backend") is fake
    assert ops.table("test-backend")["rms_norm"] == "fake"
    with pytest.raises(NotFoundError):
        ops.get("no_such_op")


@pytest.fixture
def force_device(monkeypatch):
    """force_device(name) sets $GPUCLOUD_DEVICE for this test; detect() reads it afresh."""

    def force(name: str) -> None:
        monkeypatch.setenv("GPUCLOUD_DEVICE", name)
        device.detect.cache_clear()

    yield force
    device.detect.cache_clear()


@pytest.mark.parametrize(
    ("name", "missing"),
    [
        ("npu", "torch_npu (pip install torch-npu)"),
        ("cuda", "a torch built with CUDA or ROCm (installed: torch "),
        ("xpu", "a torch built with XPU (installed: torch "),
        ("mps", "a torch built with MPS, on macOS with Apple silicon (installed: torch "),
    ],
)
def test_a_forced_backend_this_machine_lacks_says_what_is_missing(force_device, name, missing):
    force_device(name)
    with pytest.raises(UserError) as caught:
        device.detect()
    message = str(caught.value)
    assert message.startswith(f"GPUCLOUD_DEVICE={name} needs {missing}")
    assert message.endswith("; backends available here: cpu")


def test_a_forced_backend_is_used_when_present_and_a_typo_is_named(force_device):
    force_device("cpu")
    assert device.detect() is device.BACKENDS["cpu"]
    force_device("nup")
    with pytest.raises(NotFoundError, match="GPUCLOUD_DEVICE backend 'nup': did you mean npu"):
        device.detect()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpucloud.models.loader import init_model_dir

    return init_model_dir("tiny", tmp_path_factory.mktemp("hal") / "tiny", seed=0)


@pytest.mark.parametrize("command", ["train", "generate", "serve"])
def test_cli_says_in_one_line_which_package_a_forced_backend_needs(command, model_dir):
    args = {
        "train": ["train", "run", str(EXAMPLES / "tiny-ddp.toml"), "--dry-run"],
        "generate": ["generate", str(model_dir), "--prompt", "hello"],
        "serve": ["serve", str(model_dir), "--port", "0"],
    }[command]
    env = {**os.environ, "GPUCLOUD_DEVICE": "npu"}
    cli = [sys.executable, "-c", "from gpucloud.cli.main import app; app()"]
    result = subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "error: GPUCLOUD_DEVICE=npu needs torch_npu (pip install torch-npu); "
        "backends available here: cpu\n"
    )
