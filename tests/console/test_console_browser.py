"""The web console end to end in headless Chromium (Debian's, driven by Playwright): a
tenant logs in (its key in no cookie and no page), submits a job and watches it run and
succeed with its log and loss chart, cancels a job, scales a deployment and watches its
traffic charted, rolls out a second version of it and promotes it, sees its queued job's
estimated start, and never sees another tenant's job. Every page is shown at 1280 px and
at a phone's width with no console error; screenshots are kept under
tests/artifacts/console/ (or $GPUCLOUD_TEST_ARTIFACTS/console/)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from control import fake_replica
from control.conftest import Server, wait_for, wait_state
from playwright.sync_api import expect, sync_playwright

from console.conftest import login
from console.engine_stand_in import SCRIPT as ENGINE_STAND_IN

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"  # tests/install_system_packages.sh installs it
ARTIFACTS = Path(os.environ.get("GPUCLOUD_TEST_ARTIFACTS", Path(__file__).parents[1] / "artifacts"))
TIMEOUT_MS = 30_000
PAGES = ["/console/", "/console/queues", "/console/jobs", "/console/deployments",
         "/console/usage", "/console/simulator"]  # fmt: skip
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}

# A job that logs and writes metrics.jsonl as training does, then waits for the test's
# word (a file) before it ends: the test sees it RUNNING however fast the machine is.
TRAINING_LIKE = (
    'for i in 1 2 3 4 5; do echo "step $i"; '
    'echo "{\\"step\\": $i, \\"loss\\": $((10 - i)), \\"tokens_per_s\\": 1000, '
    '\\"grad_norm\\": 1.5}" >> "$GPUCLOUD_CHECKPOINT_DIR/metrics.jsonl"; done; '
    'while [ ! -e "$GPUCLOUD_CHECKPOINT_DIR/go" ]; do sleep 0.1; done; echo finished'
)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("console-home")
    srv = Server(f"sqlite:///{home / 'state.db'}", home).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keys(server) -> dict[str, str]:
    admin = server.client()
    return {n: admin.post("/tenants", {"name": n})["api_key"] for n in ("alpha", "beta")}


@pytest.fixture(scope="module")
def browser() -> Iterator:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run tests/install_system_packages.sh")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Console:
    """One tenant's browser tab, collecting console errors and page errors."""

    def __init__(self, browser, server: Server, viewport: dict) -> None:
        self.context = browser.new_context(viewport=viewport, base_url=server.url)
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("response", self._refused)
        self.page.on("dialog", lambda d: d.accept())

    def _refused(self, response) -> None:
        if response.status >= 400:
            self.errors.append(f"{response.status} {response.url}")

    def login(self, key: str) -> None:
        """With the keyboard only: the key field, then Enter."""
        self.page.goto("/console/login")
        self.page.get_by_label("API key").focus()
        self.page.keyboard.type(key)
        self.page.keyboard.press("Enter")
        self.page.wait_for_url("**/console/")
        assert key not in self.page.url and key not in self.page.content()
        assert not [c for c in self.context.cookies() if key in c["value"]]

    def shot(self, name: str) -> None:
        ARTIFACTS.joinpath("console").mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=ARTIFACTS / "console" / f"{name}.png", full_page=True)


@pytest.fixture(scope="module")
def alpha(browser, server, keys) -> Iterator[Console]:
    tab = Console(browser, server, DESKTOP)
    tab.login(keys["alpha"])
    yield tab
    tab.context.close()


def test_a_submitted_job_runs_and_succeeds_with_its_log_and_loss_chart(alpha, server, keys):
    server.client(keys["beta"]).post("/jobs", {"name": "beta-only", "command": "true"})
    page = alpha.page
    page.goto("/console/jobs")
    if page.locator("details.panel").get_attribute("open") is None:  # open while no jobs
        page.get_by_text("Submit a job").click()
    page.get_by_label("Name").fill("console-run")
    page.get_by_label("Command").fill(TRAINING_LIKE)
    page.get_by_label("Checkpoint dir").fill("runs/console-run")
    page.get_by_role("button", name="Submit").click()
    page.wait_for_url("**/console/jobs/*")
    state = page.locator("#job-state")
    expect(state).to_have_text("RUNNING")
    chart = page.locator(".chart[data-series=loss]")
    expect(chart).to_have_attribute("data-points", "5")
    expect(chart.locator("canvas")).to_have_count(1)
    expect(page.locator("#logs")).to_contain_text("step 5")
    alpha.shot("job-running")

    area = server.home / "tenants" / "alpha" / "runs" / "console-run"
    (area / "go").touch()
    expect(state).to_have_text("SUCCEEDED")
    expect(page.locator("#logs")).to_contain_text("finished")
    expect(page.locator(".charts")).to_have_attribute("data-done", "true")
    expect(page.get_by_role("button", name="Cancel job")).to_have_count(0)
    alpha.shot("job-succeeded")

    page.goto("/console/jobs")
    expect(page.get_by_role("link", name="console-run")).to_be_visible()
    assert page.get_by_text("beta-only").count() == 0
    assert alpha.errors == []  # beta's job page is a 404: test_console_http.py


def test_a_job_is_cancelled_from_its_page(alpha, server, keys):
    job = server.client(keys["alpha"]).post("/jobs", {"name": "to-cancel", "command": "sleep 300"})
    wait_state(server.client(keys["alpha"]), job["id"], "RUNNING")
    page = alpha.page
    page.goto(f"/console/jobs/{job['id']}")
    page.get_by_role("button", name="Cancel job").click()
    expect(page.locator("#job-state")).to_have_text("CANCELLED")
    alpha.shot("job-cancelled")
    assert alpha.errors == []


def test_a_deployment_is_scaled_from_the_deployments_page(alpha, server, keys):
    client = server.client(keys["alpha"])
    spec = {"name": "web", "model_dir": "/m", "replicas": 1, "command": "sleep 300"}
    client.post("/deployments", spec)
    try:
        page = alpha.page
        page.goto("/console/deployments")
        page.get_by_label("Replicas of web").fill("2")
        page.get_by_role("button", name="Scale").click()
        expect(page.locator("#dep-web .ready")).to_have_attribute("data-wanted", "2")
        expect(page.locator("#dep-web tbody tr")).to_have_count(2)
        assert client.get("/deployments/web")["replicas"] == 2
        alpha.shot("deployment-scaled")
    finally:
        client.delete("/deployments/web")
    assert alpha.errors == []


def test_a_queued_job_shows_its_estimated_start(alpha, server, keys):
    client = server.client(keys["alpha"])
    spec = {"name": "all-gpus", "command": "sleep 300", "gpus": 4, "time_limit": 600}
    hog = client.post("/jobs", spec)
    wait_state(client, hog["id"], "RUNNING")  # the scaled deployment's replicas are gone
    queued = client.post("/jobs", {"name": "queued", "command": "true"})
    try:
        page = alpha.page
        page.goto("/console/queues")
        row = page.locator("tr", has=page.get_by_role("link", name=f"{queued['id']} queued"))
        expect(row.locator(".eta")).to_have_text("in ~10 min")  # when all-gpus hits its limit
        alpha.shot("queues-estimated-start")
    finally:
        for job in (queued, hog):
            client.post(f"/jobs/{job['id']}/cancel")
    assert alpha.errors == []


def test_a_deployments_traffic_is_charted_and_a_new_version_promoted(alpha, server, keys):
    client = server.client(keys["alpha"])
    stand_in = fake_replica.spec(ENGINE_STAND_IN)
    client.post("/deployments", {"name": "chat", "replicas": 1, **stand_in})
    try:
        wait_for(lambda: client.get("/deployments/chat")["ready_replicas"] == 1)
        page = alpha.page
        page.goto("/console/deployments")
        section = page.locator("#traffic section[data-deployment=chat]")
        expect(section).to_have_count(1)  # its first sample: the baseline
        v1 = httpx.Client(base_url=server.url + "/v1", timeout=10,
                          headers={"Authorization": f"Bearer {keys['alpha']}"})  # fmt: skip
        for prompt in ("a", "b", "c", "fail"):
            v1.post("/completions", json={"model": "chat", "prompt": prompt})
        http = login(server, keys["alpha"])

        def point():
            (dep,) = http.get("/console/deployments/series").json()["deployments"]
            return dep["at"] and dep["errors_per_s"][-1] > 0 and dep

        dep = wait_for(point)
        assert dep["requests_per_s"][-1] > dep["errors_per_s"][-1] > 0
        assert 0.025 < dep["ttft_p50"][-1] <= 0.05 and 0.0025 < dep["tpot_p99"][-1] <= 0.005
        expect(section.locator("canvas")).to_have_count(3)
        alpha.shot("deployment-traffic")
        _roll_out_and_promote(alpha, stand_in)
        assert client.get("/deployments/chat")["version"] == 2
    finally:
        client.delete("/deployments/chat")
    assert alpha.errors == []


def _roll_out_and_promote(tab: Console, stand_in: dict[str, str]) -> None:
    """From the deployments page to chat's versions: version 2 at 50% (the keyboard's Enter
    in the form), both versions and the split shown, then promoted (confirmed)."""
    page = tab.page
    page.get_by_role("link", name="Versions and rollout of chat").click()
    page.wait_for_url("**/console/deployments/chat/versions")
    expect(page.get_by_label("Command")).to_have_value(stand_in["command"])  # the stable's
    page.get_by_label("Model dir").fill(stand_in["model_dir"])
    page.get_by_label("Canary percent").fill("50")
    page.get_by_label("Canary percent").press("Enter")
    split = page.locator("#split-now")
    expect(split).to_have_text("version 1 50% · canary version 2 50%")
    for number, state in ((1, "stable"), (2, "canary")):
        row = page.locator(f"#versions tr[data-version='{number}']")
        expect(row.locator(".state")).to_have_text(state)
        expect(row.locator(".percent")).to_have_text("50%")
    chart = page.locator("#split-chart")
    expect(chart).to_have_attribute("data-versions", "1 2")
    expect(chart.locator("canvas")).to_have_count(1)
    tab.shot("deployment-rollout")
    page.set_viewport_size(PHONE)
    _assert_usable(page)
    tab.shot("deployment-rollout-390")
    page.set_viewport_size(DESKTOP)

    page.get_by_role("button", name="Promote version 2").click()  # the dialog: accepted
    expect(split).to_have_text("version 2 100%")
    expect(page.locator("#versions tr[data-version='2'] .state")).to_have_text("stable")
    expect(page.locator("#versions tr[data-version='1'] .state")).to_have_text("retired")
    expect(page.get_by_role("button", name="Promote version 2")).to_have_count(0)
    tab.shot("deployment-promoted")


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["1280px", "phone"])
def test_every_page_loads_without_console_errors(browser, server, keys, viewport):
    tab = Console(browser, server, viewport)
    try:
        tab.login(keys["alpha"])
        for path in PAGES:
            tab.page.goto(path)
            tab.page.wait_for_load_state("networkidle")
            _assert_usable(tab.page)
            name = path.removeprefix("/console/") or "cluster"
            tab.shot(f"{name}-{viewport['width']}")
        tab.page.goto("/console/usage")
        expect(tab.page.locator("#month section[data-tenant=alpha] canvas")).to_have_count(2)
        tab.shot(f"usage-month-{viewport['width']}")
        tab.page.goto("/console/simulator")
        tab.page.get_by_role("button", name="Compare").click()
        expect(tab.page.locator("#sim-cdf canvas")).to_have_count(1)
        expect(tab.page.locator("#sim-table tbody tr")).to_have_count(2)
        tab.shot(f"simulator-compared-{viewport['width']}")
        assert tab.errors == []
    finally:
        tab.context.close()


def _assert_usable(page) -> None:
    """No sideways scrolling of the page, and every form field has a label."""
    wide = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert wide <= 0, f"{page.url} is {wide} px wider than the window"
    unlabelled = page.evaluate(
        """[...document.querySelectorAll('input:not([type=hidden]), select')]
           .filter(e => !e.labels.length && !e.getAttribute('aria-label')
                        && !e.closest('label')).map(e => e.outerHTML)"""
    )
    assert unlabelled == []
