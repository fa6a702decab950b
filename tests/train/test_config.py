"""Run configs that cannot work fail before any process starts, saying what to change."""

from __future__ import annotations

import os

import pytest
from train_helpers import gpucloud, run_config, write_toml

from gpucloud.errors import ConfigError
from gpucloud.hal import device
from gpucloud.train import config, launcher


def _cfg(dataset, *overrides):
    return config.parse(run_config(dataset, *overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.stratgy='fsdp'"], "parallel.stratgy: unknown key"),
        (["parallel.strategy='zero'"], "parallel.strategy: Input should be 'ddp' or 'fsdp'"),
        (["model.path='/m'"], "set exactly one of model.preset and model.path"),
        (["optim.global_batch_tokens=100"], "set exactly one of optim.global_batch"),
        (["health.on_nan='panic'"], "health.on_nan"),
        (["parallel.offload_optimizer=true"], "offload_optimizer shards states with FSDP2"),
        (["parallel.pp=2", "parallel.pipeline_stages=4"], "parallel.pp and parallel.pipeline_st"),
        (["parallel.dp_shard=2", "parallel.strategy='ddp'"], "dp_shard shards parameters with"),
        (["parallel.tp=3"], r"parallel.tp \(3\) must divide data.seq_len \(32\)"),
    ],
)
def test_bad_keys_and_values_are_named(dataset, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(dataset, *overrides)


def test_overrides_use_toml_values(dataset, tmp_path):
    path = write_toml(run_config(dataset), tmp_path / "run.toml")
    cfg = config.load(path, ["optim.lr=1e-3", "checkpoint.async=false", "logging.every=5"])
    assert (cfg.optim.lr, cfg.checkpoint.async_save, cfg.logging.every) == (1e-3, False, 5)
    with pytest.raises(ConfigError, match="use section.key=value"):
        config.load(path, ["optim.lr"])


@pytest.mark.parametrize(
    ("overrides", "nproc", "message"),
    [
        (["optim.global_batch=6"], 2, r"multiple of micro_batch × data-parallel ranks \(2 × 2"),
        (["parallel.pipeline_stages=2"], 3, "must divide the number of processes"),
        (["parallel.pipeline_stages=4", "optim.micro_batch=1"], 4, "must divide the model's 2"),
        (["parallel.pipeline_stages=2", "parallel.strategy='fsdp'"], 2, "cannot be combined"),
        (["data.path='/nonexistent'"], 2, "is not a prepared dataset"),
        (["data.seq_len=4096"], 2, "exceeds the model's max_position_embeddings"),
        (["model.preset='small'"], 1, None),  # vocab 32000 ≥ 2048: fine
        (["parallel.tp=2"], 3, r"tp × pipeline stages \(2 × 1\) must divide the number of pro"),
        (
            ["parallel.tp=2", "parallel.dp_shard=1"],
            4,
            r"\(1 × 2 × 1\) must be the number of "
            r"processes \(4\): set dp_shard = 2",
        ),
        (["parallel.tp=4", "optim.micro_batch=1"], 4, r"tp \(4\) must divide the model's 2 KV"),
        (["parallel.tp=2"], 4, "tensor parallel composes with FSDP2: set parallel.strategy"),
    ],
)
def test_preflight(dataset, overrides, nproc, message):
    cfg = _cfg(dataset, *overrides)
    if message is None:
        assert launcher.preflight(cfg, nproc).dp == nproc
        return
    with pytest.raises(ConfigError, match=message):
        launcher.preflight(cfg, nproc)


def test_the_mesh_spelling_is_the_strategy_spelling(dataset):
    """`dp_shard = 2, tp = 2, pp = 1` is strategy 'fsdp' with tp = 2 on 4 processes."""
    meshed = _cfg(dataset, "parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=1")
    named = _cfg(dataset, "parallel.strategy='fsdp'", "parallel.tp=2")
    assert meshed.parallel.strategy == "fsdp" and meshed.parallel.pipeline_stages == 1
    lay = launcher.preflight(meshed, 4)
    assert lay == launcher.preflight(named, 4)
    assert (lay.dp, lay.tp, lay.pp, lay.accum, lay.loss_ranks) == (2, 2, 1, 2, 4)
    assert [lay.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # tp ranks read the same data


def test_fsdp_on_a_backend_without_it_is_refused(dataset):
    mps = device.BACKENDS["mps"]
    with pytest.raises(ConfigError, match="the mps backend has no FSDP"):
        launcher.preflight(_cfg(dataset, "parallel.strategy='fsdp'"), 1, backend=mps)


def test_cli_bad_config_is_one_line_and_exit_2(dataset, tmp_path):
    path = write_toml(run_config(dataset, "optim.micro_batch=3"), tmp_path / "run.toml")
    result = gpucloud("train", str(path), "--nproc-per-node", "2")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "try optim.global_batch = 6" in result.stderr
    assert not (tmp_path / "runs").exists()


# The standard AWS environment, pointing at a port where nothing listens.
UNREACHABLE_S3 = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1",
                  "AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret",
                  "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
NO_ENDPOINT = "cannot reach the storage endpoint http://127.0.0.1:9 (set by AWS_ENDPOINT_URL)"


@pytest.mark.parametrize(
    ("overrides", "args", "message"),
    [
        (["checkpoint.dir='s3://ckpt/run1'"], [], f"s3://ckpt/run1: {NO_ENDPOINT}"),
        (["data.path='s3://data/stdlib'"], [], f"s3://data/stdlib: {NO_ENDPOINT}"),
        ([], ["--run-dir", "s3://ckpt/run1"], "--run-dir s3://ckpt/run1: the run dir must be a "
         "local path; put checkpoints on shared storage with checkpoint.dir = "
         "'s3://ckpt/run1/ckpt'"),
    ],
)  # fmt: skip
def test_cli_shared_storage_that_cannot_work_is_one_line_and_exit_2(
    dataset, tmp_path, overrides, args, message
):
    path = write_toml(run_config(dataset, *overrides), tmp_path / "run.toml")
    result = gpucloud("train", str(path), *args, "--dry-run", env=os.environ | UNREACHABLE_S3)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"error: {message}"


def test_cli_dry_run_prints_the_layout_and_the_torchrun_command(dataset, tmp_path):
    import json

    path = write_toml(run_config(dataset), tmp_path / "run.toml")
    result = gpucloud("train", str(path), "--nproc-per-node", "2", "--dry-run", "--json",
                      "--set", "optim.micro_batch=1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["layout"]["accum"] == 4 and plan["tokens_per_step"] == 8 * 32
    assert "--standalone" in plan["command"] and "--max-restarts=3" in plan["command"]


def test_cli_dry_run_on_two_nodes_rendezvouses_as_this_node_s_address(dataset, tmp_path):
    """Nodes that share a host name (and, in their sandboxes, their agents' pids) stay apart
    for torchrun by their addresses."""
    import json

    path = write_toml(run_config(dataset), tmp_path / "run.toml")
    result = gpucloud("train", str(path), "--nproc-per-node", "2", "--nnodes", "2", "--rdzv",
                      "10.0.0.1:29400", "--rdzv-id", "job-7-1", "--local-addr", "10.0.0.2",
                      "--dry-run", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    command = json.loads(result.stdout)["command"]
    assert "--nnodes=2" in command and "--rdzv-endpoint=10.0.0.1:29400" in command
    assert "--rdzv-id=job-7-1" in command and "--local-addr=10.0.0.2" in command


def test_cli_export_without_a_checkpoint_is_exit_2(tmp_path):
    result = gpucloud("train", "export", str(tmp_path), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "holds no committed checkpoint" in result.stderr
