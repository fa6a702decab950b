"""Shared fixtures: a real tokenizer and dataset built once, and two ways to train —
in this process on a 1-rank gloo group (fast), or through the real CLI and torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from train_helpers import run_in_process

from gpucloud.models.corpus import stdlib_text
from gpucloud.models.tokenizer import save_tokenizer, train_tokenizer
from gpucloud.train.prepare import prepare


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(2048, stdlib_text(200_000)), out, model_max_length=2048)
    return out


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(stdlib_text(300_000))
    return path


@pytest.fixture(scope="session")
def dataset(tmp_path_factory, tokenizer_dir, corpus) -> Path:
    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(tokenizer_dir, corpus, out)
    return out


@pytest.fixture(scope="session")
def process_group(tmp_path_factory):
    """A 1-rank gloo group in the test process, for in-process training."""
    store = tmp_path_factory.mktemp("pg") / "store"
    # One thread, as torchrun gives each worker: on 2 shared cores more threads only thrash.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


@pytest.fixture
def train_here(process_group, tmp_path):
    """train_here(cfg_dict, name) → (outcome, records, trainer) on one rank in-process."""

    def run(data: dict, name: str = "run"):
        return run_in_process(data, tmp_path / name)

    return run
