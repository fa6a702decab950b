"""Stream events: the templated event of a text delta is byte for byte the chunk's JSON, and a
reader behind the engine gets every queued output in one batch, streamed as the same events
as a reader that kept up."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from json_strategies import TEXT

from gpucloud.models.tokenizer import load_tokenizer
from gpucloud.serve import EngineConfig, LLMEngine, SamplingParams
from gpucloud.serve.api.bridge import EngineBridge
from gpucloud.serve.api.protocol import Formatter, sse
from gpucloud.serve.outputs import CompletionOutput, RequestOutput
from gpucloud.serve.sequence import Logprob


def delta(index: int, text: str, finish: str | None = None, logprobs=None) -> CompletionOutput:
    return CompletionOutput(index, text, [7], text, [7], finish, None, logprobs)


@given(chat=st.booleans(), model=TEXT, n=st.integers(1, 3), prompt=st.integers(0, 2),
       texts=st.lists(TEXT, min_size=1, max_size=4))  # fmt: skip
def test_event_is_the_chunk_as_sse(chat, model, n, prompt, texts):
    fmt = Formatter("cmpl-x", model, chat, n, tokenizer=None)
    out = RequestOutput("r", None, [1, 2])
    for i, text in enumerate(texts):
        c = delta(i % n, text)
        chunk = fmt.chunk(prompt, out, c, first=False)
        assert fmt.event(prompt, out, c, first=False) == (None if chunk is None else sse(chunk))


def test_event_keeps_first_last_and_logprob_chunks(tiny_model_dir):
    """The chunks a template does not cover (a choice's first, its last, one with logprobs)
    come from `chunk` itself."""
    fmt = Formatter("chatcmpl-x", "m", True, 1, load_tokenizer(tiny_model_dir))
    out = RequestOutput("r", None, [1, 2])
    cases = [(delta(0, "Hi"), True), (delta(0, "", "length"), False),
             (delta(0, "a", logprobs=[Logprob(7, -0.5, 1, {7: -0.5})]), False)]  # fmt: skip
    for c, first in cases:
        assert fmt.event(0, out, c, first) == sse(fmt.chunk(0, out, c, first))
    assert '"role": "assistant"' in fmt.event(0, out, delta(0, "Hi"), True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine.from_model_dir(tiny_model_dir, EngineConfig(kv_cache_bytes=8 << 20))


def streamed(engine: LLMEngine, stall: float) -> tuple[list[int], str]:
    """Stream one greedy request through a bridge, the event loop blocked for `stall` seconds
    once the request is in. Returns the sizes of the batches read and the events' text."""

    async def main():
        bridge = EngineBridge(engine, lambda timing: None)
        bridge.start()
        try:
            fmt = Formatter("cmpl-x", "tiny", False, 1, engine.tokenizer)
            fmt.created = 0
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            sub = bridge.submit(["hello"], params)
            time.sleep(stall)  # blocks the loop: the engine runs ahead and its steps queue up
            sizes, events = [], []
            async for batch in sub.batches():
                sizes.append(len(batch))
                for p, out in batch:
                    events += [fmt.event(p, out, c, not events) or "" for c in out.outputs]
            return sizes, "".join(events)
        finally:
            bridge.stop()

    return asyncio.run(main())


def test_a_reader_behind_the_engine_catches_up_in_one_batch(engine):
    sizes, text = streamed(engine, stall=0)
    behind_sizes, behind_text = streamed(engine, stall=3)
    assert sum(sizes) == sum(behind_sizes) == 12  # one output per step, each once
    assert max(behind_sizes) > 1
    assert behind_text == text
