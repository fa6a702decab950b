"""`gpucloud serve --speculative ngram` and `--speculative draft --draft-model DIR`: the same
completions as plain decoding, and the acceptance rate on /metrics."""

from __future__ import annotations

import subprocess
import sys

import httpx
from api_helpers import start_server

from gpucloud.models.draft import make_draft_dir
from gpucloud.serve import LLM, SamplingParams

P = "gpucloud_serve_"
PROMPTS = ["def main():", "import os\nimport sys\nimport os\n", "The quick brown fox"]


def test_ngram_speculation_serves_plain_greedy_completions(tiny_model_dir, tmp_path):
    plain = LLM(tiny_model_dir, kv_cache_bytes=1 << 22)
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2)
    want = [o.outputs[0] for o in plain.generate(PROMPTS, params)]
    server = start_server(tiny_model_dir, tmp_path, "--speculative", "ngram",
                          "--num-speculative-tokens", "4")  # fmt: skip
    try:
        for prompt, w in zip(PROMPTS, want, strict=True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                    "logprobs": 2}  # fmt: skip
            choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
            choice = choice["choices"][0]
            assert choice["text"] == w.text
            got = choice["logprobs"]["token_logprobs"]
            assert max(abs(a - b.logprob) for a, b in zip(got, w.logprobs, strict=True)) < 1e-5
        m = server.metrics()
        assert m[f"{P}spec_decode_num_accepted_tokens_total"] > 0
        assert (
            m[f"{P}spec_decode_num_draft_tokens_total"]
            >= (m[f"{P}spec_decode_num_accepted_tokens_total"])
        )
        assert 0 < m[f"{P}spec_decode_draft_acceptance_rate"] <= 1
    finally:
        assert server.stop() == 0


def test_draft_model_speculation_serves_plain_greedy_completions(tiny_model_dir, tmp_path):
    draft_dir = make_draft_dir(tiny_model_dir, tmp_path / "draft", num_layers=1)
    plain = LLM(tiny_model_dir, kv_cache_bytes=1 << 22)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    want = [o.outputs[0].text for o in plain.generate(PROMPTS, greedy)]
    server = start_server(tiny_model_dir, tmp_path, "--speculative", "draft", "--draft-model",
                          str(draft_dir), "--num-speculative-tokens", "4")  # fmt: skip
    try:
        body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 24, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert [c["text"] for c in r["choices"]] == want
        m = server.metrics()
        assert 0 < m[f"{P}spec_decode_draft_acceptance_rate"] <= 1
    finally:
        assert server.stop() == 0


def test_a_draft_model_without_speculative_draft_is_a_one_line_error(tiny_model_dir, tmp_path):
    cli = [sys.executable, "-c", "from gpucloud.cli.main import app; app()"]
    r = subprocess.run([*cli, "serve", str(tiny_model_dir), "--draft-model", str(tiny_model_dir)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2
    assert "needs speculative='draft'" in r.stderr and "Traceback" not in r.stderr
