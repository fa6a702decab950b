"""The engine end to end on the tiny model directory: step API, sampling features, limits,
threads, `LLM` and `gpucloud generate`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gpucloud.errors import CapacityError, UserError
from gpucloud.serve import LLM, EngineConfig, LLMEngine, SamplingParams

PROMPTS = ["def main():", "The quick brown fox", "import os\nimport sys\n", "x"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, kv_cache_bytes=1 << 21, block_size=8)


@pytest.fixture
def engine(llm) -> LLMEngine:
    return llm.engine


def test_generate_returns_text_and_tokens_in_prompt_order(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS + [[1, 40, 41]], greedy)
    assert [o.prompt for o in outs] == PROMPTS + [None]
    for o in outs:
        (c,) = o.outputs
        assert len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids)
    alone = llm.generate(PROMPTS[1], greedy)[0].outputs[0]
    assert alone.token_ids == outs[1].outputs[0].token_ids  # batching changes nothing


def test_step_outputs_stream_deltas_that_add_up(engine):
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0,
                                                        ignore_eos=True))  # fmt: skip
    deltas, tokens, last = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            c = out.outputs[0]
            deltas.append(c.text_delta)
            tokens += c.new_token_ids
            last = out
    assert last.finished and tokens == last.outputs[0].token_ids
    assert "".join(deltas) == last.outputs[0].text


def test_abort_stops_a_request_and_frees_its_blocks(engine):
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    keep = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=5, temperature=0))
    gone = engine.add_request(PROMPTS[2], long)
    engine.step()
    engine.abort_request(gone)
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[gone].outputs[0].finish_reason == "abort"
    assert len(finished[gone].outputs[0].token_ids) < 200
    assert keep in finished
    assert engine.blocks.usage == 0.0


def test_n_completions_share_prompt_blocks_and_seeds_reproduce(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    prompt = "class Foo(object):\n    def __init__(self):" * 3
    (out,) = llm.generate(prompt, params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    texts = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in texts}) > 1  # different samples
    (again,) = llm.generate(prompt, params)
    assert [c.token_ids for c in again.outputs] == texts  # same seed, same tokens


def test_n_completions_reuse_the_parents_blocks_without_prefix_caching(tiny_model_dir):
    llm = LLM(tiny_model_dir, kv_cache_bytes=1 << 21, block_size=4, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request(list(range(3, 40)), SamplingParams(n=3, temperature=1.0, max_tokens=4))
    shared = False
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        if len(running) == 3:
            tables = [s.block_table[:9] for s in running]
            shared |= tables[0] == tables[1] == tables[2]
    assert shared
    assert engine.stats().prompt_tokens < 37 + 2 * 4  # the siblings recomputed < 1 block each


def test_stop_strings_and_stop_tokens_end_generation(llm):
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPTS[0], greedy)[0].outputs[0]
    stop_at = full.text[5:8]
    cut = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0,
                                                  ignore_eos=True, stop=[stop_at]))  # fmt: skip
    c = cut[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_at
    assert full.text.startswith(c.text) and stop_at not in c.text
    token = full.token_ids[3]
    by_token = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0,
                                                       stop_token_ids=[token]))  # fmt: skip
    c = by_token[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == token
    assert c.token_ids[-1] == token and token not in c.token_ids[:-1]


def test_logprobs_come_back_per_token(llm):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    c = llm.generate(PROMPTS[1], params)[0].outputs[0]
    assert [lp.token_id for lp in c.logprobs] == c.token_ids
    assert all(lp.rank == 1 and len(lp.top) == 2 and lp.logprob < 0 for lp in c.logprobs)


def test_requests_that_cannot_fit_are_rejected_with_a_clear_error(tiny_model_dir):
    engine = LLMEngine.from_model_dir(tiny_model_dir, EngineConfig(kv_cache_bytes=64 * 1024,
                                                                   block_size=8))  # fmt: skip
    cap = engine.capacity_tokens
    with pytest.raises(CapacityError, match=f"can never fit the KV cache of {cap} tokens"):
        engine.add_request([5] * 10, SamplingParams(max_tokens=cap))
    with pytest.raises(UserError, match="exceeds the model's context length of 2048"):
        engine.add_request([5] * 2000, SamplingParams(max_tokens=100))
    with pytest.raises(UserError, match="the prompt is empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(UserError, match="token ids must be integers in \\[0, 2048\\)"):
        engine.add_request([5000], SamplingParams())
    rid = engine.add_request([5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(UserError, match="already in use"):
        engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id=rid)
    assert not engine.scheduler.has_unfinished() and engine.has_unfinished()


def test_a_background_thread_can_drive_steps_while_requests_arrive(engine):
    stop = threading.Event()
    results: dict[str, object] = {}

    def loop():
        while not stop.is_set() or engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out

    worker = threading.Thread(target=loop)
    worker.start()
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0)) for p in PROMPTS]
    stop.set()
    worker.join(timeout=120)
    assert set(results) == set(ids)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.generation_tokens > 0


def test_cli_generate_prints_json(tiny_model_dir):
    gpucloud = str(Path(sys.executable).with_name("gpucloud"))
    cmd = [gpucloud, "generate", str(tiny_model_dir),
           "--prompt", "def f(x):", "--prompt", "import", "--max-tokens", "5",
           "--ignore-eos", "--kv-cache-mb", "4", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [len(c["token_ids"]) for c in data["completions"]] == [5, 5]
    assert data["kv_cache"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # k+v, layers, heads, dim
    bad = subprocess.run(cmd[:3] + ["--prompt", "x", "--top-p", "0"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "top_p must be in (0, 1]" in bad.stderr
