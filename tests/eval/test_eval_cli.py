"""`gpucloud eval` and `gpucloud eval compare` as a user runs them: task files checked with
one-line errors (exit 2), results as JSON with a seeded bootstrap interval, and the
regression gate's exit code on results that differ by a lot, a little, or not at all."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from pathlib import Path

import pytest
from cli_run import run_cli

from gpucloud.eval.tasks import load_task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "eval"

MC = [
    {"context": "The capital of France is", "choices": [" Paris", " London"], "answer": 0},
    {"context": "Water boils at", "choices": [" 100 degrees", " noon"], "answer": 0},
    {"context": "import os\nimport", "choices": [" sys", " numpy as np"], "answer": 1},
]


@pytest.mark.parametrize(
    ("name", "kind"),
    [("facts", "multiple_choice"), ("docs", "perplexity"), ("short_answers", "generation")],
)
def test_the_example_tasks_are_a_few_dozen_items_each(name, kind):
    task = load_task(EXAMPLES / f"{name}.jsonl")
    assert task.kind == kind and 24 <= len(task.items) <= 60


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def write_result(path, items, kind="multiple_choice", metric="acc", task_hash="sha256:" + "0" * 64):
    result = {"task": "t", "metric": metric, "task_hash": task_hash, "kind": kind, "items": items}
    path.write_text(json.dumps(result))
    return str(path)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["{not json"], "t.jsonl:1: not JSON"),
        ([{"question": "q", "choices": ["a", "b"], "answer": 0}], "match no task shape"),
        ([MC[0], {"text": "x"}], "t.jsonl:2: keys ['text'], but this multiple_choice task"),
        ([{**MC[0], "answer": 2}], "t.jsonl:1: answer must be an index in [0, 1]"),
        ([{**MC[0], "choices": ["only one"]}], "choices must be a list of at least 2 strings"),
        ([{"prompt": "p", "answer": "a", "max_tokens": 0}], "max_tokens must be an integer >= 1"),
        ([{"text": "  "}], "t.jsonl:1: text must be a non-empty string"),
        ([], "no items"),
    ],
)
def test_bad_task_files_are_one_line_errors(capsys, monkeypatch, tmp_path, rows, message):
    task = write_jsonl(tmp_path / "t.jsonl", rows)
    r = run_cli(capsys, monkeypatch, "eval", str(tmp_path), "--task", task)
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("rows", "stride", "message"),
    [
        (MC, "5", "--stride is for perplexity tasks; t is multiple_choice"),
        ([{"text": "x"}], "0", "--stride 0 must be at least 1 token"),
    ],
)
def test_a_bad_stride_is_a_one_line_error(capsys, monkeypatch, tmp_path, rows, stride, message):
    task = write_jsonl(tmp_path / "t.jsonl", rows)
    r = run_cli(capsys, monkeypatch, "eval", str(tmp_path), "--task", task, "--stride", stride)
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_model_dir_scored_in_process(capsys, monkeypatch, tmp_path, tiny_model_dir):
    task = write_jsonl(tmp_path / "mc.jsonl", MC)
    args = ["eval", str(tiny_model_dir), "--task", task, "--kv-cache-mb", "4", "--json"]
    first = run_cli(capsys, monkeypatch, *args)
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout)
    assert {"task", "metric", "score", "ci_low", "ci_high", "n"} <= result.keys()
    assert (result["task"], result["metric"], result["n"]) == ("mc", "acc", 3)
    assert result["ci_low"] <= result["score"] <= result["ci_high"]
    assert set(result["metrics"]) == {"acc", "acc_norm"}
    # The same seed gives the same interval; the table names every metric and the task hash.
    assert json.loads(run_cli(capsys, monkeypatch, *args).stdout)["metrics"] == result["metrics"]
    table = run_cli(capsys, monkeypatch, *args[:-1], "--metric", "acc_norm")
    assert "acc_norm" in table.stdout and result["task_hash"] in table.stdout
    wrong = run_cli(capsys, monkeypatch, *args, "--metric", "exact_match")
    assert wrong.returncode == 2
    assert "has no metric 'exact_match': use acc, acc_norm" in wrong.stderr
    # Two models (here the same one twice) are scored on --task and compared.
    same = run_cli(capsys, monkeypatch, "eval", "compare", str(tiny_model_dir),
                   str(tiny_model_dir), "--task", task, "--kv-cache-mb", "4")  # fmt: skip
    assert same.returncode == 0 and "B is not worse than A" in same.stdout


def test_compare_fails_only_when_b_is_worse_beyond_noise(capsys, monkeypatch, tmp_path):
    right = [{"acc": 1.0, "acc_norm": 1.0}] * 40
    a = write_result(tmp_path / "a.json", right)
    half = write_result(tmp_path / "half.json", right[:20] + [{"acc": 0.0, "acc_norm": 0.0}] * 20)
    one = write_result(tmp_path / "one.json", right[:39] + [{"acc": 0.0, "acc_norm": 0.0}])
    worse = run_cli(capsys, monkeypatch, "eval", "compare", a, half, "--json")
    assert worse.returncode == 1 and worse.stderr == "error: B is worse than A beyond noise\n"
    verdict = json.loads(worse.stdout)
    assert verdict["worse"] and verdict["difference"] == -0.5
    assert verdict["ci_low"] <= -0.5 <= verdict["ci_high"] < 0
    # One item of 40 is within the noise of which items the task has; better is never worse.
    assert run_cli(capsys, monkeypatch, "eval", "compare", a, one).returncode == 0
    better = run_cli(capsys, monkeypatch, "eval", "compare", half, a)
    assert better.returncode == 0 and "B - A 0.5" in better.stdout


def test_compare_knows_lower_perplexity_is_better(capsys, monkeypatch, tmp_path):
    def docs(ll):
        return [{"loglikelihood": ll + i % 3, "words": 10.0, "bytes": 50.0} for i in range(30)]

    def result(name, ll):
        return write_result(tmp_path / name, docs(ll), "perplexity", "word_perplexity")

    low, high = result("low.json", -20.0), result("high.json", -40.0)
    r = run_cli(capsys, monkeypatch, "eval", "compare", low, high, "--metric", "bits_per_byte")
    assert r.returncode == 1 and "lower is better" in r.stdout
    assert run_cli(capsys, monkeypatch, "eval", "compare", high, low).returncode == 0


def test_compare_refuses_results_of_different_task_files(capsys, monkeypatch, tmp_path):
    item = [{"acc": 1.0, "acc_norm": 1.0}]
    a = write_result(tmp_path / "a.json", item)
    b = write_result(tmp_path / "b.json", item, task_hash="sha256:" + "1" * 64)
    r = run_cli(capsys, monkeypatch, "eval", "compare", a, b)
    assert r.returncode == 2 and "compare results of the same task file" in r.stderr
    (tmp_path / "c.json").write_text("{}")
    r = run_cli(capsys, monkeypatch, "eval", "compare", a, str(tmp_path / "c.json"))
    assert r.returncode == 2 and "is not a result of `gpucloud eval ... --json`" in r.stderr
    r = run_cli(capsys, monkeypatch, "eval", "compare", a, "some/model")
    assert r.returncode == 2 and "--task FILE.jsonl is required" in r.stderr


def test_a_text_longer_than_the_context_is_scored_in_rolling_windows(tiny_model_dir):
    """A text of 3x the context: each token scored once, in windows one token shorter than
    the context (room for the token an endpoint must generate) that advance by their length
    - 1 (lm-eval's), as the model computes those windows directly; a text that fits is one
    window, scored with its whole context."""
    import torch

    from gpucloud.eval.engine_backend import EngineBackend
    from gpucloud.models.loader import load_model

    model = load_model(tiny_model_dir)

    def direct(ids: list[int], scored: int) -> list[float]:
        """The logprobs of the last `scored` tokens of `ids`, given the tokens before them."""
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0].double().log_softmax(-1)
        return [logits[p - 1, ids[p]].item() for p in range(len(ids) - scored, len(ids))]

    short = EngineBackend(tiny_model_dir, max_model_len=32, kv_cache_bytes=4 << 20)
    assert short.max_length == 31
    text = " ".join(f"w{i % 7}" for i in range(48))
    ids = short.llm.tokenizer.encode(text)
    assert 3 * 32 <= len(ids) < 4 * 32
    expected = direct(ids[:31], 30)  # the first window: its tokens after the bos
    end = 31
    while end < len(ids):  # each next: 30 tokens further, the 31 tokens up to there
        new_end = min(end + 30, len(ids))
        expected += direct(ids[new_end - 31 : new_end], new_end - end)
        end = new_end
    (windowed,) = short.text_logprobs([text])
    assert windowed[0] is None and len(windowed) == len(ids)
    assert sum(windowed[1:]) == pytest.approx(sum(expected), rel=1e-4)
    assert windowed[1:] == pytest.approx(expected, abs=1e-3)

    whole = EngineBackend(tiny_model_dir, max_model_len=128, kv_cache_bytes=4 << 20)
    (fits,) = whole.text_logprobs([text])
    assert fits == whole.prompt_logprobs([text])[0]
    assert sum(fits[1:]) == pytest.approx(sum(direct(ids, len(ids) - 1)), rel=1e-4)
    assert sum(fits[1:]) != pytest.approx(sum(windowed[1:]), rel=1e-4)  # context mattered


def test_an_endpoint_without_tokenize_is_a_one_line_error(capsys, monkeypatch, tmp_path):
    """Another OpenAI-compatible server (a stand-in with /v1/models only): perplexity needs
    its tokens, so the error names the missing route."""
    task = tmp_path / "ppl.jsonl"
    task.write_text(json.dumps({"text": "a text to score"}) + "\n")
    with _models_only_server() as url:
        r = run_cli(capsys, monkeypatch, "eval", url, "--task", str(task))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert f"{url} has no tokenize route" in r.stderr and "POST /tokenize" in r.stderr


@contextlib.contextmanager
def _models_only_server():
    """An HTTP server on 127.0.0.1 that lists one model and answers 404 to the rest."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                self._answer(200, {"object": "list", "data": [{"id": "other"}]})
            else:
                self._answer(404, {"detail": "Not Found"})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer(404, {"detail": "Not Found"})

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
