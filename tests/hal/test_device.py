import os
import subprocess
import sys

import pytest

from gpucloud.errors import NotFoundError
from gpucloud.hal import device, ops


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
    assert "test-backend" in ops.available()["rms_norm"]
    with pytest.raises(NotFoundError):
        ops.get("no_such_op")
