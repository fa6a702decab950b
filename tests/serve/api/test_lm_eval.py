"""lm-evaluation-harness, a client nobody here wrote, against a real `gpucloud serve`: its
`local-completions` model must score every item as its `hf` model does on the same model
directory (multiple choice, rolling perplexity, generation). Tasks are local YAML files over
local JSONL data, and the harness runs offline: nothing is downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from api_helpers import start_server

TOLERANCE = 1e-4
STEP_TOKENS = 32  # the harness's longer prompts are computed in several chunks

MULTIPLE_CHOICE = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "a red bike"],
     "answer": 0},
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"],
     "answer": 0},
    {"question": "Water boils at", "choices": [" 100 degrees", " 10 degrees", " noon"],
     "answer": 0},
    {"question": "import os\nimport", "choices": [" sys", " numpy as np", " os.path"],
     "answer": 0},
]  # fmt: skip
TEXTS = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "def main():\n    for i in range(10):\n        print(i * i)\n\n" * 6},
    {"text": "Serving engines batch requests so that a step computes many tokens at once."},
]
QUESTIONS = [
    {"question": "def add(a, b):\n    return", "answer": " a + b"},
    {"question": "The capital of France is", "answer": " Paris"},
    {"question": "for i in range(", "answer": "10"},
]
TASKS = {
    "gpucloud_mc": (MULTIPLE_CHOICE, {
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "metric_list": [{"metric": "acc"}],
    }),
    "gpucloud_ppl": (TEXTS, {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}],
    }),
    "gpucloud_gen": (QUESTIONS, {
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "answer",
        "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
    }),
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"),
                     "--max-num-batched-tokens", str(STEP_TOKENS))  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """One YAML per task, each over its own JSONL file (the `json` dataset builder)."""
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, (docs, config) in TASKS.items():
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        task = {"task": name, "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
                **config}  # fmt: skip
        (out / f"{name}.yaml").write_text(yaml.safe_dump(task))
    return out


def run_lm_eval(model: str, model_args: dict, task_dir: Path, out: Path) -> dict[str, list]:
    """`lm_eval run` offline in its own process; each task's logged samples by doc id."""
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(out / "hf")}
    env = os.environ | offline | {"TOKENIZERS_PARALLELISM": "false"}
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", args,
           "--tasks", ",".join(TASKS), "--include_path", str(task_dir), "--batch_size", "4",
           "--device", "cpu", "--output_path", str(out), "--log_samples"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    samples = {}
    for name in TASKS:
        (path,) = out.rglob(f"samples_{name}_*.jsonl")
        docs = [json.loads(line) for line in path.read_text().splitlines()]
        samples[name] = [d["resps"] for d in sorted(docs, key=lambda d: d["doc_id"])]
    return samples


@pytest.fixture(scope="module")
def results(server, tiny_model_dir, task_dir, tmp_path_factory):
    served = run_lm_eval("local-completions", {
        "model": "tiny", "base_url": f"{server.url}/v1/completions",
        "tokenizer": tiny_model_dir, "tokenizer_backend": "huggingface", "max_retries": 1,
        "add_bos_token": True,  # as the hf model does by default (our tokenizer adds bos)
    }, task_dir, tmp_path_factory.mktemp("served"))  # fmt: skip
    # The same float32 weights as the server. hf sums a continuation's token logprobs in the
    # softmax's dtype: at float32 that sum alone is off by ~1e-4 on a 150-token text (the
    # harness sums the server's in Python floats), so its softmax runs in float64.
    reference = run_lm_eval("hf", {"pretrained": tiny_model_dir, "dtype": "float32",
                                   "softmax_dtype": "float64"}, task_dir,
                            tmp_path_factory.mktemp("hf"))  # fmt: skip
    return served, reference


def loglikelihoods(resps: list) -> list[tuple[float, bool | None]]:
    """(loglikelihood, is_greedy) per request of one doc; rolling ones have no is_greedy."""
    out = []
    for (resp,) in resps:
        value = resp if isinstance(resp, list) else [resp]
        out.append((float(value[0]), None if len(value) == 1 else str(value[1]) == "True"))
    return out


@pytest.mark.parametrize("task", ["gpucloud_mc", "gpucloud_ppl"])
def test_loglikelihoods_match_the_hf_model(results, task):
    served, reference = results
    assert len(served[task]) == len(reference[task]) == len(TASKS[task][0])
    worst = 0.0
    for got, want in zip(served[task], reference[task], strict=True):
        got, want = loglikelihoods(got), loglikelihoods(want)
        assert [g for _, g in got] == [w for _, w in want]  # is_greedy agrees too
        assert all(w < 0 for w, _ in want)  # real scores, not the zeros of before
        worst = max(worst, *(abs(g - w) for (g, _), (w, _) in zip(got, want, strict=True)))
    print(f"{task}: max abs loglikelihood difference vs hf = {worst:.3g}")
    assert worst < TOLERANCE


def test_generations_match_the_hf_model(results):
    served, reference = results
    assert served["gpucloud_gen"] == reference["gpucloud_gen"]
    assert any(text for ((text,),) in served["gpucloud_gen"])
