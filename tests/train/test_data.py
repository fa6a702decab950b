"""`data prepare` (resumable, txt and jsonl) and the deterministic sample order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpucloud.errors import ConfigError
from gpucloud.train.data import TokenWindows, first_sample, read_info, seeded_index
from gpucloud.train.prepare import PROGRESS, prepare


class _Interrupt(Exception):
    pass


def _files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".bin", ".idx")}


def test_interrupted_prepare_resumes_to_the_same_bytes(tokenizer_dir, corpus, tmp_path):
    whole = prepare(tokenizer_dir, corpus, tmp_path / "whole", batch_bytes=20_000)
    calls = []

    def stop_after_three(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) == 3:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        prepare(tokenizer_dir, corpus, tmp_path / "resumed", batch_bytes=20_000,
                on_progress=stop_after_three)  # fmt: skip
    progress = json.loads((tmp_path / "resumed" / PROGRESS).read_text())
    assert 0 < progress["offset"] < corpus.stat().st_size
    assert not (tmp_path / "resumed" / "meta.json").exists()
    resumed = prepare(tokenizer_dir, corpus, tmp_path / "resumed", batch_bytes=20_000)
    assert resumed["splits"] == whole["splits"]
    assert _files(tmp_path / "resumed") == _files(tmp_path / "whole")
    assert whole["splits"]["val"]["documents"] > 0  # the held-out split is not empty


def test_jsonl_documents_get_bos_and_eos(tokenizer_dir, tmp_path):
    from gpucloud.models.tokenizer import load_tokenizer

    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "Return the sum."}\n\n{"text": "日本語 and emoji 🙂"}\n')
    meta = prepare(tokenizer_dir, src, tmp_path / "out", val_fraction=0.0)
    tok = load_tokenizer(tokenizer_dir)
    tokens = np.fromfile(tmp_path / "out" / "train.bin", dtype=meta["dtype"]).tolist()
    starts = np.fromfile(tmp_path / "out" / "train.idx", dtype=np.uint64).tolist()
    assert starts == [0, len(tok.encode("Return the sum.")) + 1]
    second = tokens[starts[1] :]
    assert second[0] == tok.bos_id and second[-1] == tok.eos_id
    assert tok.decode(second) == "日本語 and emoji 🙂"


def test_bad_inputs_say_what_is_wrong(tokenizer_dir, tmp_path, dataset):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ConfigError, match="'text' field"):
        prepare(tokenizer_dir, bad, tmp_path / "out")
    with pytest.raises(ConfigError, match="does not exist"):
        prepare(tokenizer_dir, tmp_path / "missing.txt", tmp_path / "out2")
    with pytest.raises(ConfigError, match="already holds a prepared dataset"):
        prepare(tokenizer_dir, bad, dataset)
    with pytest.raises(ConfigError, match="gpucloud data prepare"):
        read_info(tmp_path)


def test_sample_order_is_a_seeded_permutation_per_epoch(dataset):
    info = read_info(dataset)
    windows = TokenWindows(info, seq_len=32, seed=7)
    again = TokenWindows(info, seq_len=32, seed=7)
    other = TokenWindows(info, seq_len=32, seed=8)
    n = windows.num_windows
    assert np.array_equal(windows.batch(5, 4), again.batch(5, 4))
    assert not np.array_equal(windows.batch(0, 4), other.batch(0, 4))
    epochs = [[seeded_index(e * n + i, n, seed=7) for i in range(n)] for e in (0, 1)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(n))
    assert epochs[0] != epochs[1]
    batch = windows.batch(n - 1, 2)  # crosses into the next epoch
    assert batch.shape == (2, 33) and batch.dtype == np.int64


@pytest.mark.parametrize(("dp", "mb"), [(1, 8), (2, 2), (4, 1), (2, 4)])
def test_a_step_reads_the_same_samples_however_it_is_split(dp, mb):
    batch = 8
    accum = batch // (dp * mb)
    read = sorted(
        first_sample(3, micro, rank, global_batch=batch, dp=dp, mb=mb) + k
        for micro in range(accum)
        for rank in range(dp)
        for k in range(mb)
    )
    assert read == list(range(24, 32))
