"""Prompt logprobs over HTTP, checked against transformers' own log-softmax on the same model
directory: `echo` with `logprobs` (what evaluation harnesses send), `max_tokens: 0` and vLLM's
`prompt_logprobs`. The server's small step budget splits long prompts across steps (chunked
prefill) and its prefix cache holds every earlier prompt, so both paths are exercised."""

from __future__ import annotations

import httpx
import pytest
import torch
from api_helpers import assert_openai_error, start_server

TOLERANCE = 1e-4
STEP_TOKENS = 16  # prompts longer than this are computed in several chunks


def _random_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, 2048, (n - 1,), generator=gen).tolist()


SHORT = _random_ids(6, 0)
LONG = _random_ids(70, 1)  # five chunks of the step budget


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--block-size", "4",
                     "--max-num-batched-tokens", str(STEP_TOKENS))  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Token ids -> [len, vocab] log-probabilities by transformers: row i is the distribution
    of the token that follows ids[: i + 1]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()

    @torch.inference_mode()
    def logprobs(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return logprobs


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from gpucloud.models.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def complete(http: httpx.Client, **fields) -> dict:
    r = http.post("/v1/completions", json={"model": "tiny", "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def prompt_scores(want: torch.Tensor, ids: list[int]) -> list[float]:
    """transformers' logprob of each prompt token after the first."""
    return [float(want[i - 1, ids[i]]) for i in range(1, len(ids))]


def assert_close(got: list[float], expected: list[float]) -> None:
    assert len(got) == len(expected)
    worst = max((abs(g - e) for g, e in zip(got, expected, strict=True)), default=0.0)
    assert worst < TOLERANCE, f"max abs difference {worst}"


@pytest.mark.parametrize("ids", [SHORT, LONG], ids=["short", "chunked"])
def test_echo_with_logprobs_scores_every_prompt_token_as_transformers_does(http, reference, ids):
    # What lm-evaluation-harness sends for a loglikelihood request.
    body = complete(http, prompt=ids, echo=True, logprobs=1, max_tokens=1)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert len(lp["tokens"]) == len(ids) + 1  # every prompt token, then the generated one
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = reference(ids)
    assert_close(lp["token_logprobs"][1 : len(ids)], prompt_scores(want, ids))
    generated = int(want[-1].argmax())
    assert_close([lp["token_logprobs"][-1]], [float(want[-1, generated])])
    for i in range(1, len(ids)):
        (best,) = lp["top_logprobs"][i].values()  # logprobs=1: the most likely token
        assert abs(best - float(want[i - 1].max())) < TOLERANCE
    assert body["usage"]["completion_tokens"] == 1


def test_prompt_tokens_in_the_prefix_cache_are_still_scored(http, reference):
    # The first request fills the prefix cache with LONG's blocks; the second would hit them.
    plain = complete(http, prompt=LONG, max_tokens=1)
    again = complete(http, prompt=LONG, max_tokens=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    body = complete(http, prompt=LONG, echo=True, logprobs=0, max_tokens=1)
    scores = body["choices"][0]["logprobs"]["token_logprobs"]
    assert_close(scores[1 : len(LONG)], prompt_scores(reference(LONG), LONG))
    # Documented choice: a request with prompt logprobs recomputes its prompt.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (
        plain["choices"][0]["text"]
        == body["choices"][0]["text"][-len(plain["choices"][0]["text"]) :]
    )


def test_echo_offsets_count_from_the_start_of_the_echoed_prompt(http, tokenizer):
    text = "The quick brown fox"
    body = complete(http, prompt=text, echo=True, logprobs=2, max_tokens=3)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    ids = tokenizer.encode(text)
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["tokens"][: len(ids)] == [tokenizer.decode([t], False) for t in ids]
    offsets, at = [], 0
    for token in lp["tokens"]:
        offsets.append(at)
        at += len(token)
    assert lp["text_offset"] == offsets
    assert choice["text"].startswith(text)
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])


def test_max_tokens_0_with_echo_scores_the_prompt_alone(http, reference):
    body = complete(http, prompt=[SHORT, LONG], echo=True, logprobs=1, max_tokens=0)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for ids, choice in zip([SHORT, LONG], body["choices"], strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids)
        assert lp["token_logprobs"][0] is None
        assert_close(lp["token_logprobs"][1:], prompt_scores(reference(ids), ids))
        assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(SHORT) + len(LONG)
    text = "The quick brown fox"
    (echoed,) = complete(http, prompt=text, echo=True, max_tokens=0)["choices"]
    assert echoed["text"] == text and echoed["logprobs"] is None


def test_vllm_prompt_logprobs_are_per_token_dicts(http, reference, tokenizer):
    body = complete(http, prompt=SHORT, prompt_logprobs=2, max_tokens=2)
    (choice,) = body["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(SHORT) and entries[0] is None
    assert choice["logprobs"] is None  # only asked for the prompt's
    want = reference(SHORT)
    for i in range(1, len(SHORT)):
        entry = entries[i]
        token = str(SHORT[i])
        assert token in entry and 2 <= len(entry) <= 3  # the prompt token and the top 2
        assert abs(entry[token]["logprob"] - float(want[i - 1, SHORT[i]])) < TOLERANCE
        assert entry[token]["rank"] == int((want[i - 1] > want[i - 1, SHORT[i]]).sum()) + 1
        assert entry[token]["decoded_token"] == tokenizer.decode([SHORT[i]], False)
        top = sorted(entry.values(), key=lambda e: e["rank"])[:2]
        assert [e["rank"] for e in top] == [1, 2]
        assert abs(top[0]["logprob"] - float(want[i - 1].max())) < TOLERANCE


def test_streamed_echo_sends_the_prompt_logprobs_first(http):
    whole = complete(http, prompt=SHORT, echo=True, logprobs=1, max_tokens=4)
    with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": SHORT,
                     "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0,
                     "stream": True}) as r:  # fmt: skip
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    merged = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        for key in merged:
            merged[key] += lp[key] if lp else []
    want = whole["choices"][0]["logprobs"]
    assert merged == {key: want[key] for key in merged}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": "all"}, "prompt_logprobs"),
    ],
    ids=["max_tokens-0-without-echo", "negative-max_tokens", "too-many", "negative", "string"],
)
def test_bad_prompt_logprob_requests_are_400(http, fields, param):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, **fields})
    error = assert_openai_error(r, 400)
    assert error["param"] == param and param in error["message"]
