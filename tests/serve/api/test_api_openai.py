"""The official `openai` client against a real `gpucloud serve` process: what it returns is
what the offline engine computes for the same model and sampling parameters."""

from __future__ import annotations

import httpx
import openai
import pytest
from api_helpers import start_server
from docs_page import assert_docs_are_served_locally

from gpucloud.serve import LLM, SamplingParams

KEY = "sk-test-key"
PROMPT = "def main():"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, kv_cache_bytes=1 << 22)


def greedy(llm: LLM, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm.generate(prompt, params)[0].outputs[0].text


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 2048


def test_completion_matches_the_offline_engine(client, offline):
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion"
    assert r.choices[0].text == greedy(offline, PROMPT, 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 12


def test_chat_renders_the_template_and_matches_the_offline_engine(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt = offline.tokenizer.apply_chat_template(messages)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == greedy(offline, prompt, 10)
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))


def test_streamed_completion_adds_up_to_the_whole_one(client):
    args = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_streamed_chat_sends_the_role_then_the_content(client):
    args = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story"}],
                max_tokens=15, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_completions_are_distinct_choices(client):
    r = client.completions.create(
        model="tiny", prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == 24


def test_n_streamed_chat_choices_each_finish(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6,
        temperature=0.8, stream=True, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    finished = {c.choices[0].index for c in chunks if c.choices[0].finish_reason == "length"}
    assert finished == {0, 1}


def test_batched_prompts_get_one_choice_each(client, offline):
    prompts = ["import os", "class A:"]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    texts = {c.index: c.text for c in r.choices}
    assert texts == {i: greedy(offline, p, 5) for i, p in enumerate(prompts)}


def test_stop_string_ends_the_text_before_it(client):
    args = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})  # fmt: skip
    text = client.completions.create(**args).choices[0].text
    stop = text[6:9]
    r = client.completions.create(**args, stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**args, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Pick words"}], max_tokens=16,
            temperature=1.0, top_p=0.95, seed=seed, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return r.choices[0].message.content

    assert sample(42) == sample(42)
    assert sample(42) != sample(43)


def test_logprobs_come_per_token(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and value <= 0
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely token
        assert top[token] == pytest.approx(value)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_tokenize_and_detokenize_are_vllm_s(server, offline):
    """vLLM's POST /tokenize and /detokenize, beside /v1 and behind the same key: the
    served model's tokens, bos first unless add_special_tokens is false."""
    keyed = {"Authorization": f"Bearer {KEY}"}

    def post(path: str, body: dict, headers=keyed) -> httpx.Response:
        return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)

    ids = offline.tokenizer.encode(PROMPT)
    assert ids[0] == offline.tokenizer.bos_id and len(ids) > 2
    r = post("/tokenize", {"model": "tiny", "prompt": PROMPT})
    assert r.json() == {"count": len(ids), "max_model_len": 2048, "tokens": ids}
    bare = post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False,
                              "return_token_strs": True}).json()  # fmt: skip
    assert bare["tokens"] == ids[1:] and bare["count"] == len(ids) - 1
    assert len(bare["token_strs"]) == len(ids) - 1 and all(bare["token_strs"])
    text = post("/detokenize", {"model": "tiny", "tokens": ids}).json()["prompt"]
    assert text == offline.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith(PROMPT) and text != PROMPT  # the bos is written out
    assert post("/tokenize", {"prompt": "x"}, headers={}).status_code == 401
    assert post("/detokenize", {"tokens": [1]}, headers={}).status_code == 401


def test_a_wrong_key_is_refused(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_errors_reach_the_client_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError, match="did you mean tiny"):
        client.completions.create(model="tinyy", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context length of 2048"):
        client.completions.create(model="tiny", prompt="x", max_tokens=4000)
    # Loading LoRA adapters at run time reads server paths: off unless the server allows it.
    with pytest.raises(openai.NotFoundError, match="--runtime-lora-updating"):
        client.post("/load_lora_adapter", body={"lora_name": "a", "lora_path": "/"}, cast_to=str)


def test_docs_pages_load_every_asset_from_the_server(server):
    assert_docs_are_served_locally(server.url)
