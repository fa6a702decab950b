"""Token datasets on disk and the deterministic order training reads them in.

A dataset directory (written by `gpucloud data prepare`) holds, per split, a flat token file
`SPLIT.bin` (uint16 when the vocabulary fits, else uint32) and a document index
`SPLIT.idx` (uint64 start offsets), plus `meta.json`, written last. Training reads windows
of `seq_len + 1` tokens through a memory map; which window a rank reads is a pure function
of (seed, step, micro-step, rank), so a resumed run reads exactly what it would have read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from gpucloud.errors import ConfigError

META = "meta.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class DatasetInfo:
    path: Path
    dtype: str
    vocab_size: int
    tokenizer: str | None
    splits: dict[str, dict[str, int]]

    def tokens(self, split: str = "train") -> int:
        return self.splits[split]["tokens"]


def read_info(path: str | Path) -> DatasetInfo:
    """Read `meta.json` of a prepared dataset. ConfigError says how to make one."""
    path = Path(path)
    meta = path / META
    if not meta.is_file():
        raise ConfigError(
            f"{path} is not a prepared dataset (no {META}); make one with "
            "`gpucloud data prepare --tokenizer MODEL_DIR --input FILE --out DIR`"
        )
    data = json.loads(meta.read_text())
    if data.get("format") != FORMAT_VERSION:
        raise ConfigError(f"{meta}: unsupported dataset format {data.get('format')!r}")
    return DatasetInfo(
        path=path,
        dtype=data["dtype"],
        vocab_size=data["vocab_size"],
        tokenizer=data.get("tokenizer"),
        splits=data["splits"],
    )


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class TokenWindows:
    """Fixed windows of `seq_len + 1` tokens over one split, in a seeded order per epoch.

    Window w covers tokens [w·seq_len, w·seq_len + seq_len + 1): inputs are the first
    seq_len tokens, targets the last seq_len. Global sample g is window perm_e[g mod W] of
    epoch e = g div W, where perm_e is a permutation seeded by (seed, e).
    """

    def __init__(self, info: DatasetInfo, seq_len: int, seed: int, split: str = "train"):
        self.seq_len, self.seed = seq_len, seed
        self.tokens = np.memmap(info.path / f"{split}.bin", dtype=info.dtype, mode="r")
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(
                f"{info.path}: the {split} split has {len(self.tokens)} tokens, fewer than "
                f"one sequence of data.seq_len + 1 = {seq_len + 1}; use more text or a "
                "shorter seq_len"
            )

    def window(self, sample: int) -> np.ndarray:
        start = seeded_index(sample, self.num_windows, self.seed) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def batch(self, first_sample: int, count: int) -> np.ndarray:
        """[count, seq_len + 1] int64 tokens of samples first_sample ... + count - 1."""
        return np.stack([self.window(first_sample + k) for k in range(count)]).astype(np.int64)


@lru_cache(maxsize=4)  # two epochs live at a time (of one or two datasets per process)
def _epoch_order(count: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(count)


def seeded_index(sample: int, count: int, seed: int) -> int:
    """The item global sample `sample` reads out of `count`: each epoch (`count` samples)
    visits every item once, in an order seeded by (seed, epoch)."""
    epoch, i = divmod(sample, count)
    return int(_epoch_order(count, seed, epoch)[i])


def first_sample(step: int, micro: int, dp_rank: int, *, global_batch: int, dp: int, mb: int):
    """Index of the first sample rank `dp_rank` reads at 0-based `step`, micro-step `micro`.

    A step reads samples [step·B, (step+1)·B); micro-step m of every rank reads a
    contiguous block, so the step's samples do not depend on how B is split.
    """
    return step * global_batch + (micro * dp + dp_rank) * mb
