"""`gpucloud serve --lora-modules`: the official `openai` client picks a PEFT adapter by model
name and gets what the offline engine computes with that adapter; adapters are listed with
their parent, loaded and unloaded at run time, and bad ones refused with one line."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from api_helpers import assert_openai_error, start_server

from gpucloud.serve import LLM, LoRARequest, SamplingParams

PROMPTS = {"alpha": "def main():", "tiny": "def main():", "beta": "import os\n"}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_model_dir, lora_dirs, tmp_path_factory):
    # vLLM's form: several NAME=PATH after one --lora-modules.
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--lora-modules",
                     f"alpha={lora_dirs['alpha']}", f"beta={lora_dirs['beta']}",
                     "--max-loras", "2", "--runtime-lora-updating")  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model_dir, lora_dirs) -> dict[str, str]:
    """Greedy texts of the offline LLM, by model name (one generate call, adapters mixed)."""
    llm = LLM(tiny_model_dir, kv_cache_bytes=1 << 22, enable_lora=True)
    loras = [None if m == "tiny" else LoRARequest(m, i, str(lora_dirs[m]))
             for i, m in enumerate(PROMPTS)]  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(list(PROMPTS.values()), params, lora_request=loras)
    return {m: o.outputs[0].text for m, o in zip(PROMPTS, outs, strict=True)}


def _complete(client, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPTS.get(model, PROMPTS["alpha"]),
                                  max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.model == model
    return r.choices[0].text


def test_models_lists_the_adapters_with_their_parent(client, lora_dirs):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny", "alpha", "beta"]
    assert cards["tiny"].parent is None
    assert cards["alpha"].parent == "tiny" and cards["alpha"].root == str(lora_dirs["alpha"])


def test_the_model_name_picks_the_adapter(client, offline):
    with ThreadPoolExecutor(3) as pool:  # concurrent: the engine batches them together
        texts = dict(zip(PROMPTS, pool.map(lambda m: _complete(client, m), PROMPTS), strict=True))
    assert texts == offline
    assert texts["alpha"] != texts["tiny"]  # the same prompt: the adapter changed the answer
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "gamma")
    assert e.value.body["code"] == "model_not_found"
    assert "unknown model 'gamma'" in e.value.body["message"]


def test_adapters_load_and_unload_at_run_time(server, client, lora_dirs, offline):
    url = server.url
    body = {"lora_name": "gamma", "lora_path": str(lora_dirs["alpha"])}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30)
    assert r.status_code == 200 and "gamma" in r.text
    assert _complete(client, "gamma") == offline["alpha"]  # alpha's weights under a new name
    assert_openai_error(httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30), 400)
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gamma"}, timeout=30)
    assert r.status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny", "alpha", "beta"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gamma"}, timeout=30)
    assert_openai_error(r, 404)
    bad = {"lora_name": "delta", "lora_path": str(lora_dirs["alpha"].parent)}
    e = assert_openai_error(httpx.post(f"{url}/v1/load_lora_adapter", json=bad, timeout=30), 400)
    assert "no adapter_config.json" in e["message"]


def test_a_bad_adapter_at_start_is_one_line_and_exit_2(tiny_model_dir, lora_dirs):
    cli = [sys.executable, "-c", "from gpucloud.cli.main import app; app()", "serve"]
    args = [str(tiny_model_dir), "--kv-cache-bytes", "1000000", "--port", "1"]
    for extra, message in [
        (["--lora-modules", f"alpha={lora_dirs['alpha']}", "--max-lora-rank", "4"],
         "LoRA adapter 'alpha' has rank 8: the server takes ranks 1..4"),
        (["--lora-modules", "alpha"], "--lora-modules 'alpha': give NAME=PATH"),
    ]:  # fmt: skip
        r = subprocess.run([*cli, *args, *extra], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
        assert message in r.stderr
