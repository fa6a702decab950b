"""`gpucloud serve --tensor-parallel-size 2`: the official `openai` client gets what one rank
computes, and killing the server (SIGKILL: no cleanup code runs) leaves no worker behind."""

from __future__ import annotations

import time
from pathlib import Path

import openai
from api_helpers import start_server

from gpucloud.serve import LLM, SamplingParams

PROMPT = "def main():"


def test_two_ranks_answer_the_openai_client_and_die_with_the_server(tiny_model_dir, tmp_path):
    # float64: the two ranks' partial sums must not flip a greedy choice by rounding
    server = start_server(tiny_model_dir, tmp_path, "--tensor-parallel-size", "2",
                          "--dtype", "float64")  # fmt: skip
    try:
        workers = _children(server.proc.pid, b"gpucloud.serve.tp_worker")
        assert len(workers) == 1
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        with LLM(tiny_model_dir, kv_cache_bytes=1 << 22, dtype="float64") as one:
            assert r.choices[0].text == one.generate(PROMPT, params)[0].outputs[0].text
        assert r.usage.completion_tokens == 12
    finally:
        server.proc.kill()
        server.proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "a tensor-parallel worker outlived its server"
        time.sleep(0.05)


def _children(parent: int, marker: bytes) -> list[int]:
    """Pids of `parent`'s child processes whose command line contains `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.split(") ")[1].split()[1]) == parent and marker in cmdline:
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
