"""A tensor-parallel worker: `python -m gpucloud.serve.tp_worker`, started by the engine.

It loads its shard of the model, joins the driver's group, and then does what the driver's
messages say: run the forward pass of a step over its shard (its heads' KV blocks live
here), compute its rows of some logits, or report its memory. It has no scheduler
and no requests: the driver's block tables say where each token's K/V goes.

A worker must not outlive its engine: it exits when the pipe on its stdin closes, which
happens when the driver's process ends however it ends (SIGKILL included). Not
PR_SET_PDEATHSIG: that fires when the *thread* that started the worker exits, and an
engine may well be built in a thread that ends before it does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

FORWARD, START, MEMORY, LORA = "forward", "start", "memory", "lora"  # the driver's messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store-dir", required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--config", required=True, help="the EngineConfig, as JSON")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    _exit_with_parent()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from gpucloud.hal import device as hal_device
    from gpucloud.serve.config import EngineConfig
    from gpucloud.serve.tp_group import TensorParallelGroup, file_store, rank_device
    from gpucloud.serve.tp_layers import load_rank, wire

    config = EngineConfig(**json.loads(args.config))
    store = file_store(Path(args.store_dir), args.size)
    device = rank_device(config, args.rank)
    if device.type != "cpu":
        hal_device.set_device(device.index)
    model = load_rank(args.model_dir, config, args.rank, args.size, device)
    store.set(f"loaded/{args.rank}", "1")  # the driver waits for it before it joins
    group = TensorParallelGroup(store, args.rank, args.size, device)
    wire(model, group, args.vocab_size)
    serve(model, config, group)


def serve(model, config, group) -> None:
    """Answer the driver's messages, until the driver is gone."""
    import torch

    from gpucloud.models.lora import install_lora_layers, load_slot
    from gpucloud.models.tensor_parallel import Shard
    from gpucloud.serve.runner import ModelRunner
    from gpucloud.serve.tp_layers import LOGITS, parameter_bytes

    class Runner(ModelRunner):
        def forward(self, inputs, lora_groups) -> None:
            if lora_layers:  # every forward sets its own rows' slots ([] for none)
                model.lora_batch.groups = lora_groups
            self._forward(inputs)  # the driver keeps the result: it has the same

    shard = Shard(group.rank, group.size)
    lora_layers = {}
    if config.enable_lora:  # the driver's slots, each holding this rank's part
        lora_layers = install_lora_layers(model, config.max_loras, config.max_lora_rank)
    runner = None
    with torch.inference_mode():
        while True:
            kind, *payload = group.receive()
            if kind == FORWARD:
                runner.forward(*payload)
            elif kind == LORA:
                load_slot(lora_layers, *payload, shard)
            elif kind == LOGITS:
                model.lm_head.gather(payload[0])
            elif kind == START:
                runner = Runner(model, config, payload[0])
                group.active = True
            elif kind == MEMORY:
                group.gather_ints([parameter_bytes(model), runner.cache.nbytes])


def _exit_with_parent() -> None:
    def watch() -> None:
        sys.stdin.buffer.read()  # returns at EOF: the driver's end of the pipe closed
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    main()
