"""One task set scored three ways on the same tiny model directory: in this process through
the engine, through a real `gpucloud serve` (the endpoint backend), and by
lm-evaluation-harness's `hf` model (transformers). Every per-item loglikelihood agrees
within 1e-4, generations are identical, and so are the scores.

The engine and the server compute long prompts in chunks (a small step budget), so scores
that span chunks are checked too. lm-eval's default rolling loglikelihood also scores the
bos its tokenizer adds (as the text's first token, given bos); with `add_bos_token=False`
it scores the text given bos, which is what perplexity here means.
"""

from __future__ import annotations

import json
import math

import pytest
from cli_run import run_cli
from serve.api.api_helpers import free_port, start_server

from gpucloud.eval.endpoint import EndpointBackend
from gpucloud.eval.engine_backend import EngineBackend
from gpucloud.eval.results import evaluate
from gpucloud.eval.tasks import load_task

TOLERANCE = 1e-4
STEP_TOKENS = 32  # prompts longer than this are computed in several steps
KV_CACHE_BYTES = 1 << 22

MULTIPLE_CHOICE = [
    {"context": "The capital of France is", "choices": [" Paris", " London", " a red bike"],
     "answer": 0},
    {"context": "def add(a, b):\n    return ", "choices": ["a + b", "a - b", "None"],
     "answer": 1},  # the space ending the context moves to the choices
    {"context": "Water boils at", "choices": [" 100 degrees", " 10 degrees", " noon"],
     "answer": 2},
    {"context": "import os\nimport", "choices": [" sys", " numpy as np", " os.path"],
     "answer": 1},
    {"context": "Serving engines batch requests so that a step computes many tokens at once, "
                "and a scheduler decides", "choices": [" which", " when", " nothing at all"],
     "answer": 0},
]  # fmt: skip
TEXTS = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "def main():\n    for i in range(10):\n        print(i * i)\n\n" * 6},
    {"text": "Serving engines batch requests so that a step computes many tokens at once."},
]
GENERATION = [
    {"prompt": "def add(a, b):\n    return", "answer": " a + b"},
    {"prompt": "The capital of France is", "answer": " Paris", "stop": [".", "\n"]},
    {"prompt": "for i in range(", "answer": "10", "max_tokens": 7},
]
TASKS = {"mc": MULTIPLE_CHOICE, "ppl": TEXTS, "gen": GENERATION}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks")
    for name, items in TASKS.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    return out


@pytest.fixture(scope="module")
def tasks(task_dir):
    return {name: load_task(task_dir / f"{name}.jsonl") for name in TASKS}


@pytest.fixture(scope="module")
def in_process(tiny_model_dir, tasks):
    backend = EngineBackend(tiny_model_dir, kv_cache_bytes=KV_CACHE_BYTES,
                            max_num_batched_tokens=STEP_TOKENS)  # fmt: skip
    return {name: evaluate(task, backend) for name, task in tasks.items()}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"),
                     "--max-num-batched-tokens", str(STEP_TOKENS))  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def endpoint(server, tasks):
    backend = EndpointBackend(server.url)
    yield {name: evaluate(task, backend) for name, task in tasks.items()}
    backend.close()


@pytest.fixture(scope="module")
def harness(tiny_model_dir):
    """lm-eval's `hf` model on the same float32 weights; its softmax in float64, so its sums
    carry no float32 rounding of their own."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    def hf(**extra):
        return HFLM(pretrained=str(tiny_model_dir), dtype="float32", softmax_dtype="float64",
                    batch_size=4, device="cpu", **extra)  # fmt: skip

    def requests(kind, args):
        return [Instance(kind, {}, a, i) for i, a in enumerate(args)]

    lm = hf()
    mc = [(d["context"], c) for d in MULTIPLE_CHOICE for c in d["choices"]]
    lls = [ll for ll, _ in lm.loglikelihood(requests("loglikelihood", mc))]
    gen = [(d["prompt"], {"until": d.get("stop", ["\n\n"]), "max_gen_toks": d.get("max_tokens", 32),
                          "do_sample": False}) for d in GENERATION]  # fmt: skip
    outputs = lm.generate_until(requests("generate_until", gen))
    rolling = hf(add_bos_token=False).loglikelihood_rolling(
        requests("loglikelihood_rolling", [(d["text"],) for d in TEXTS])
    )
    return {"mc": _by_item(lls), "ppl": rolling, "gen": outputs}


def _by_item(lls: list[float]) -> list[list[float]]:
    out, it = [], iter(lls)
    for d in MULTIPLE_CHOICE:
        out.append([next(it) for _ in d["choices"]])
    return out


def _loglikelihoods(result: dict) -> list:
    key = "loglikelihoods" if result["kind"] == "multiple_choice" else "loglikelihood"
    return [r[key] for r in result["items"]]


def _flat(values) -> list[float]:
    return [x for v in values for x in (v if isinstance(v, list) else [v])]


def _assert_close(got, want) -> None:
    got, want = _flat(got), _flat(want)
    assert len(got) == len(want)
    assert all(w < 0 for w in want)  # real scores
    worst = max(abs(g - w) for g, w in zip(got, want, strict=True))
    print(f"max abs loglikelihood difference: {worst:.3g}")
    assert worst < TOLERANCE


@pytest.mark.parametrize("task", ["mc", "ppl"])
def test_loglikelihoods_match_lm_eval_and_the_endpoint(in_process, endpoint, harness, task):
    ours = _loglikelihoods(in_process[task])
    _assert_close(ours, harness[task])
    _assert_close(_loglikelihoods(endpoint[task]), ours)


def test_multiple_choice_scores_are_lm_eval_s(in_process, endpoint, harness):
    def accuracy(lls, norm):
        hits = [
            max(range(len(row)), key=lambda i: row[i] / norm(d["choices"][i])) == d["answer"]
            for row, d in zip(lls, MULTIPLE_CHOICE, strict=True)
        ]
        return sum(hits) / len(hits)

    want = {"acc": accuracy(harness["mc"], lambda c: 1), "acc_norm": accuracy(harness["mc"], len)}
    assert 0 < want["acc"] < 1  # the items tell a right choice from a wrong one
    for result in (in_process["mc"], endpoint["mc"]):
        assert {m: v["score"] for m, v in result["metrics"].items()} == want
        assert result["score"] == want["acc"] and result["n"] == len(MULTIPLE_CHOICE)
        assert result["ci_low"] <= result["score"] <= result["ci_high"]
    assert in_process["mc"]["metrics"] == endpoint["mc"]["metrics"]  # CIs too: one seed


def test_perplexity_scores_are_lm_eval_s(in_process, endpoint, harness):
    from lm_eval.api.metrics import bits_per_byte, weighted_perplexity
    from lm_eval.api.task import ConfigurableTask

    words = [ConfigurableTask.count_words(d["text"]) for d in TEXTS]
    sizes = [ConfigurableTask.count_bytes(d["text"]) for d in TEXTS]
    want_word_ppl = weighted_perplexity(list(zip(harness["ppl"], words, strict=True)))
    want_bpb = bits_per_byte(list(zip(harness["ppl"], sizes, strict=True)))
    for result in (in_process["ppl"], endpoint["ppl"]):
        got = result["metrics"]
        assert result["metric"] == "word_perplexity"
        assert abs(math.log(got["word_perplexity"]["score"]) - math.log(want_word_ppl)) < 1e-5
        assert abs(got["bits_per_byte"]["score"] - want_bpb) < 1e-5
        assert got["bits_per_byte"]["ci_low"] < want_bpb < got["bits_per_byte"]["ci_high"]


def test_generations_are_lm_eval_s(in_process, endpoint, harness):
    for result in (in_process["gen"], endpoint["gen"]):
        assert [r["output"] for r in result["items"]] == harness["gen"]
    assert any(harness["gen"])
    # The stop strings ended the second completion before its first "." or newline.
    assert not {".", "\n"} & set(in_process["gen"]["items"][1]["output"])


def test_results_name_the_task_file_they_measured(in_process, endpoint, tasks):
    for name, task in tasks.items():
        assert in_process[name]["task_hash"] == endpoint[name]["task_hash"] == task.hash
        assert task.hash.startswith("sha256:") and len(task.hash) == 7 + 64


def test_endpoint_errors_are_one_line(capsys, monkeypatch, server, task_dir):
    task = str(task_dir / "mc.jsonl")
    wrong = run_cli(capsys, monkeypatch, "eval", f"{server.url}/v1", "--model", "nope",
                    "--task", task)  # fmt: skip
    assert wrong.returncode == 2 and "answered 404" in wrong.stderr and "nope" in wrong.stderr
    gone = run_cli(capsys, monkeypatch, "eval", f"http://127.0.0.1:{free_port()}", "--task", task)
    assert gone.returncode == 1 and "cannot reach" in gone.stderr
