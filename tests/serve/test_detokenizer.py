"""Incremental detokenization with the byte-level BPE of a real model directory."""

from __future__ import annotations

import pytest

from gpucloud.models.tokenizer import load_tokenizer
from gpucloud.serve.detokenizer import IncrementalDetokenizer

TEXT = "Größe 世界 🙂 naïve — déjà vu, def f(x): return x ** 2"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def stream(tok, ids, stop=(), include=False):
    detok = IncrementalDetokenizer(tok.decode, [tok.bos_id], list(stop), include)
    deltas, matched = [], None
    for t in ids:
        matched = detok.add(t)
        deltas.append(detok.delta(finished=matched is not None))
        if matched:
            break
    detok.flush()
    deltas.append(detok.delta(finished=True))
    return deltas, detok.text, matched


def test_streamed_text_equals_the_full_decode_and_never_splits_a_character(tok):
    ids = tok.encode(TEXT, add_bos=False)
    assert len(ids) > len(TEXT.split())  # multi-byte characters span several tokens
    deltas, text, _ = stream(tok, ids)
    assert "".join(deltas) == text == tok.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_a_stop_string_ends_the_text_and_is_never_streamed(tok):
    ids = tok.encode(TEXT, add_bos=False)
    deltas, text, matched = stream(tok, ids, stop=["déjà"])
    assert matched == "déjà"
    assert text == "Größe 世界 🙂 naïve — "
    assert "".join(deltas) == text and not any("d" in d for d in deltas)
    _, text, _ = stream(tok, ids, stop=["déjà"], include=True)
    assert text.endswith("— déjà")


def test_truncated_bytes_at_the_end_are_released_as_replacement_characters(tok):
    ids = tok.encode("🙂", add_bos=False)
    if len(ids) < 2:
        pytest.skip("the emoji is one token in this vocabulary")
    deltas, text, _ = stream(tok, ids[:-1])
    assert deltas[:-1] == [""] * (len(ids) - 1)  # nothing released while incomplete
    assert text.endswith("\ufffd")
