"""Web console page loads with 1,000 jobs in the store: each page's HTML over HTTP (the
server's work: queries and templates) and the whole page in headless Chromium (HTML, the
vendored scripts and styles, and its first live data), against GET /healthz measured the
same way in the same run.

A real `gpucloud server` (SQLite, 4 virtual GPUs) whose node is cordoned, so the 1,000 jobs
submitted through the API all stay queued: the queues page lists every one of them.

    python benchmarks/console.py [--jobs 1000] [--runs 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from control_plane import _best, _port, _start

PAGES = [
    "/console/",
    "/console/queues",
    "/console/jobs",
    "/console/jobs?limit=1000",
    "/console/jobs/1",
    "/console/deployments",
    "/console/usage",
    "/console/simulator",
]
CHROMIUM = "/usr/bin/chromium"


def _fill(base: str, key: str, jobs: int) -> None:
    api = httpx.Client(base_url=base + "/api/v1", headers={"Authorization": f"Bearer {key}"})
    api.post("/nodes/vm/cordon").raise_for_status()  # nothing starts: every job stays queued

    def submit(i: int) -> None:
        api.post("/jobs", json={"name": f"bench-{i}", "command": "true"}).raise_for_status()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(submit, range(jobs)))


def _http_times(base: str, key: str, runs: int) -> dict[str, float]:
    """Median seconds per page (HTML only), and /healthz's."""
    http = httpx.Client(base_url=base, timeout=30)
    assert http.post("/console/login", data={"key": key}).status_code == 303
    out = {}
    for path in ["/healthz", *PAGES]:
        http.get(path).raise_for_status()  # warm
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            http.get(path).raise_for_status()
            times.append(time.perf_counter() - t0)
        out[path] = statistics.median(times)
    return out


def _browser_times(base: str, key: str, runs: int) -> dict[str, float] | None:
    """Best seconds per page to its load event in headless Chromium, and /healthz's."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if not Path(CHROMIUM).exists():
        return None
    out = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(base_url=base)
        page.goto("/console/login")
        page.get_by_label("API key").fill(key)
        page.get_by_role("button", name="Log in").click()
        page.wait_for_url("**/console/")
        for path in ["/healthz", *PAGES]:
            out[path] = _best(runs, lambda path=path: page.goto(path, wait_until="load"))
        browser.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpucloud-bench-console-") as tmp:
        home = Path(tmp)
        port = _port()
        proc, key = _start(home, f"sqlite:///{home / 'state.db'}", port)
        base = f"http://127.0.0.1:{port}"
        try:
            t0 = time.perf_counter()
            _fill(base, key, args.jobs)
            print(f"{args.jobs} jobs queued in {time.perf_counter() - t0:.1f} s")
            http = _http_times(base, key, args.runs)
            browser = _browser_times(base, key, max(args.runs // 4, 3))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"{'page':28} {'HTML ms':>9} {'x healthz':>10} {'browser ms':>11} {'x healthz':>10}")
    for path in ["/healthz", *PAGES]:
        line = f"{path:28} {http[path] * 1e3:9.1f} {http[path] / http['/healthz']:10.1f}"
        if browser is not None:
            line += f" {browser[path] * 1e3:11.1f} {browser[path] / browser['/healthz']:10.1f}"
        print(line)
    if browser is None:
        print("(no browser column: playwright or /usr/bin/chromium missing)", file=sys.stderr)
    slowest = max(PAGES, key=lambda p: (browser or http)[p])
    print(f"slowest page: {slowest}, {(browser or http)[slowest] * 1e3:.0f} ms (target < 1000 ms)")


if __name__ == "__main__":
    main()
