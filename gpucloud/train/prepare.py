"""`gpucloud data prepare`: tokenize a corpus into the flat token files training reads.

Input is a text file (documents separated by blank lines) or JSON lines (a "text" field
per line). Documents are tokenized in batches by the tokenizers library's thread pool,
each wrapped as bos + tokens + eos, and sent to the held-out split when a hash of their
text says so (stable across runs and resumes). After every batch the byte offset reached
in the input and the token counts are recorded in `progress.json`; a restarted prepare
truncates the outputs to those counts and continues from that offset. `meta.json` is
written last: its presence means the dataset is complete.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from gpucloud.errors import ConfigError
from gpucloud.train.data import FORMAT_VERSION, META, token_dtype

PROGRESS = "progress.json"
SPLITS = ("train", "val")


def _documents(f: BinaryIO, jsonl: bool, start: int) -> Iterator[tuple[str, int]]:
    """(document, input offset just past it) from byte offset `start`."""
    f.seek(start)
    if jsonl:
        for line in iter(f.readline, b""):
            if line.strip():
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError):
                    raise ConfigError(
                        f"line at byte {f.tell() - len(line)} is not a JSON object with a "
                        "'text' field"
                    ) from None
                yield text, f.tell()
        return
    lines: list[bytes] = []
    for line in iter(f.readline, b""):
        if line.strip():
            lines.append(line)
        elif lines:
            yield b"".join(lines).decode("utf-8", errors="replace").strip("\n"), f.tell()
            lines = []
    if lines:
        yield b"".join(lines).decode("utf-8", errors="replace").strip("\n"), f.tell()


def _is_val(text: str, val_fraction: float) -> bool:
    return zlib.crc32(text.encode()) % 10_000 < val_fraction * 10_000


class _Writer:
    """Appends documents to SPLIT.bin / SPLIT.idx; truncates to a recorded state on resume."""

    def __init__(self, out: Path, dtype: np.dtype, state: dict[str, dict[str, int]]):
        self.dtype, self.state = dtype, state
        self.bins, self.idxs = {}, {}
        for split in SPLITS:
            counts = state[split]
            self.bins[split] = _open_truncated(
                out / f"{split}.bin", counts["tokens"] * dtype.itemsize
            )
            self.idxs[split] = _open_truncated(out / f"{split}.idx", counts["documents"] * 8)

    def add(self, split: str, ids: list[int]) -> None:
        counts = self.state[split]
        np.array([counts["tokens"]], dtype=np.uint64).tofile(self.idxs[split])
        np.asarray(ids, dtype=self.dtype).tofile(self.bins[split])
        counts["tokens"] += len(ids)
        counts["documents"] += 1

    def flush(self) -> None:
        for f in (*self.bins.values(), *self.idxs.values()):
            f.flush()

    def close(self) -> None:
        for f in (*self.bins.values(), *self.idxs.values()):
            f.close()


def _open_truncated(path: Path, size: int) -> BinaryIO:
    f = path.open("r+b" if path.exists() else "w+b")
    f.truncate(size)
    f.seek(size)
    return f


def prepare(
    tokenizer_dir: Path,
    input_path: Path,
    out: Path,
    val_fraction: float = 0.01,
    batch_bytes: int = 1 << 20,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Tokenize `input_path` into `out`; returns the meta.json content.

    Resumes an interrupted prepare of the same input into the same `out`. Raises
    ConfigError for a missing input, a bad JSON line or a finished `out` directory.
    """
    from gpucloud.models.tokenizer import load_tokenizer

    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if not input_path.is_file():
        raise ConfigError(f"input {input_path} does not exist")
    if (out / META).exists():
        raise ConfigError(f"{out} already holds a prepared dataset; choose a new --out")
    tok = load_tokenizer(tokenizer_dir)
    dtype = token_dtype(tok.vocab_size)
    size = input_path.stat().st_size
    out.mkdir(parents=True, exist_ok=True)
    state = _read_progress(out, input_path, size)
    writer = _Writer(out, dtype, state["splits"])
    jsonl = input_path.suffix in (".jsonl", ".json")
    try:
        with input_path.open("rb") as f:
            batch: list[str] = []
            pending = 0
            for text, offset in _documents(f, jsonl, state["offset"]):
                batch.append(text)
                pending += len(text)
                if pending >= batch_bytes:
                    _flush(batch, tok, writer, val_fraction, state, offset, out)
                    batch, pending = [], 0
                    if on_progress:
                        on_progress(offset, size)
            if batch:
                _flush(batch, tok, writer, val_fraction, state, size, out)
    finally:
        writer.close()
    meta = {
        "format": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "tokenizer": str(tokenizer_dir.resolve()),
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "source": str(input_path.resolve()),
        "val_fraction": val_fraction,
        "splits": state["splits"],
    }
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    (out / PROGRESS).unlink(missing_ok=True)
    if on_progress:
        on_progress(size, size)
    return meta


def _flush(batch, tok, writer: _Writer, val_fraction, state, offset: int, out: Path) -> None:
    encodings = tok.backend.encode_batch(batch, add_special_tokens=False)  # parallel (Rust)
    bos = [tok.bos_id] if tok.bos_id is not None else []
    eos = [tok.eos_id] if tok.eos_id is not None else []
    for text, enc in zip(batch, encodings, strict=True):
        writer.add("val" if _is_val(text, val_fraction) else "train", bos + enc.ids + eos)
    writer.flush()
    state["offset"] = offset
    tmp = out / f"{PROGRESS}.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(out / PROGRESS)


def _read_progress(out: Path, input_path: Path, size: int) -> dict:
    fresh = {
        "input": str(input_path.resolve()),
        "input_bytes": size,
        "offset": 0,
        "splits": {s: {"tokens": 0, "documents": 0} for s in SPLITS},
    }
    file = out / PROGRESS
    if not file.is_file():
        return fresh
    state = json.loads(file.read_text())
    if state["input"] != fresh["input"] or state["input_bytes"] != size:
        raise ConfigError(
            f"{out} holds an unfinished prepare of {state['input']}; use a new --out "
            "or the same input"
        )
    return state
