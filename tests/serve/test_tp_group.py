"""The tensor-parallel group's device collectives for backends other than gloo: an
out-of-tree backend (as torch_npu registers HCCL) is found among torch's registered plugins,
with either of their two construction APIs, and a missing one is a one-line error."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gpucloud.errors import UserError
from gpucloud.serve.tp_group import TIMEOUT, device_group, file_store


def _gloo(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _gloo_extended(options, _pg_options):
    assert options.timeout == TIMEOUT and list(options.global_ranks_in_group) == [0, 1]
    return _gloo(options.store, options.group_rank, options.group_size, options.timeout)


dist.Backend.register_backend("testccl", _gloo, devices=["cpu"])
dist.Backend.register_backend("testcclx", _gloo_extended, extended_api=True, devices=["cpu"])


@pytest.mark.parametrize("name", ["testccl", "testcclx"])
def test_a_registered_plugin_backend_carries_the_collectives(name, tmp_path) -> None:
    store = file_store(tmp_path, 2)
    sums: dict[int, float] = {}

    def rank(r: int) -> None:
        group = device_group(name, store, r, 2)
        x = torch.tensor([float(r + 1)])
        group.allreduce([x]).wait(timedelta(seconds=30))
        sums[r] = x.item()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sums == {0: 3.0, 1: 3.0}


def test_a_backend_this_torch_lacks_is_a_one_line_error(tmp_path) -> None:
    with pytest.raises(UserError) as error:
        device_group("hccl", file_store(tmp_path, 1), 0, 1)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("tensor-parallel serving over hccl: this torch has no hccl backend")
    assert "gloo" in message and "testccl" in message
