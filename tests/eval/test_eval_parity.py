"""One task set scored three ways on the same tiny model directory: in this process through
the engine, through a real `gpucloud serve` (the endpoint backend), and by
lm-evaluation-harness's `hf` model (transformers). Every per-item loglikelihood agrees
within 1e-4, generations are identical, and so are the scores.

The engine and the server compute long prompts in chunks (a small step budget), so scores
that span chunks are checked too. lm-eval's default rolling loglikelihood also scores the
bos its tokenizer adds (as the text's first token, given bos); with `add_bos_token=False`
it scores the text given bos, which is what perplexity here means. The context is short, so
a text three times as long is scored in rolling windows: in this process, through the
server's /tokenize and token-id prompts, and by lm-eval's own windows.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from cli_run import run_cli
from serve.api.api_helpers import free_port, start_server

from gpucloud.errors import UserError
from gpucloud.eval.compare import compare
from gpucloud.eval.endpoint import EndpointBackend
from gpucloud.eval.engine_backend import EngineBackend
from gpucloud.eval.results import evaluate
from gpucloud.eval.tasks import load_task

TOLERANCE = 1e-4
STEP_TOKENS = 32  # prompts longer than this are computed in several steps
KV_CACHE_BYTES = 1 << 22
MAX_MODEL_LEN = 128  # windows of 127 tokens

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
    {"text": " ".join(f"step {i}: token {i * 7 % 31}," for i in range(34))},  # 3x the context
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
def engine(tiny_model_dir):
    return EngineBackend(tiny_model_dir, kv_cache_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
                         max_num_batched_tokens=STEP_TOKENS)  # fmt: skip


@pytest.fixture(scope="module")
def in_process(engine, tasks):
    return {name: evaluate(task, engine) for name, task in tasks.items()}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--max-num-batched-tokens",
                     str(STEP_TOKENS), "--max-model-len", str(MAX_MODEL_LEN))  # fmt: skip
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
    # lm-eval's window of L tokens predicts L tokens (its last input predicts one more);
    # ours of the context - 1 tokens predicts one fewer than it holds.
    rolling = hf(add_bos_token=False, max_length=MAX_MODEL_LEN - 2).loglikelihood_rolling(
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


def test_a_text_3x_the_context_scores_alike_in_process_and_through_the_endpoint(
    in_process, endpoint, server
):
    """The long text is cut in the server's tokens (its /tokenize) in the engine's windows:
    its loglikelihood agrees, and both results record the windows they used."""
    said = httpx.post(f"{server.url}/tokenize", json={"prompt": TEXTS[-1]["text"]}).json()
    assert said["count"] >= 3 * MAX_MODEL_LEN and said["max_model_len"] == MAX_MODEL_LEN
    for result in (in_process["ppl"], endpoint["ppl"]):
        assert (result["max_length"], result["stride"]) == (MAX_MODEL_LEN - 1, MAX_MODEL_LEN - 2)
    here, there = (r["ppl"]["items"][-1]["loglikelihood"] for r in (in_process, endpoint))
    assert here < 0 and abs(here - there) < TOLERANCE


def test_a_stride_is_scored_alike_and_recorded(capsys, monkeypatch, engine, in_process,
                                                server, task_dir, tasks):  # fmt: skip
    """`--stride 40`: more windows, each token with more context; the endpoint's result
    (the CLI's JSON) agrees with the engine's, records its stride, and compare refuses to
    weigh it against the default stride's."""
    r = run_cli(capsys, monkeypatch, "eval", server.url, "--task", str(task_dir / "ppl.jsonl"),
                "--stride", "40", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    there = json.loads(r.stdout)
    here = evaluate(tasks["ppl"], engine, stride=40)
    assert there["stride"] == here["stride"] == 40
    _assert_close(_loglikelihoods(there), _loglikelihoods(here))
    default = _loglikelihoods(in_process["ppl"])
    assert here["items"][-1]["loglikelihood"] != pytest.approx(default[-1], abs=1e-3)
    for short in (0, 2):  # one window each: the stride changes nothing
        assert here["items"][short] == in_process["ppl"]["items"][short]
    with pytest.raises(UserError, match="compare results of one --stride"):
        compare(in_process["ppl"], here)
    wide = run_cli(capsys, monkeypatch, "eval", server.url, "--task",
                   str(task_dir / "ppl.jsonl"), "--stride", "127")  # fmt: skip
    assert wide.returncode == 2
    assert "--stride 127 is out of range: from 1 to 126" in wide.stderr
