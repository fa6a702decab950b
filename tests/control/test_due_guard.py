"""The `gpucloud` preset's due guard on a real control plane (SQLite and PostgreSQL).

Shortest GPU-time first lets short jobs overtake a big one; the guard's virtual FIFO,
kept across the reconciler's passes, says when FIFO would have started the big one, and
from then on it goes first: it preempts the later arrivals that hold its GPUs, and holds
a reservation that no later arrival overtakes while it waits for those it may not stop.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpucloud.scheduler import Wait

from .conftest import Server, wait_for, wait_state

# Seconds between the end of what held B's GPUs and B's start that we accept as "when
# FIFO would have started B": the pass that sees the end starts B (measured: 0.1 s).
MARGIN = 8.0
# Seconds the short jobs run. Were the virtual FIFO rebuilt each pass (or under plain
# shortest-first), B would wait for them: about this long after A's end.
HOLD_SHORT = 40


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request, tmp_path) -> Iterator[Server]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'state.db'}"
    else:
        url = request.getfixturevalue("postgres").new_database()
    srv = Server(url, tmp_path / "home", gpus=4, extra=("--policy", "gpucloud")).start()
    yield srv
    srv.stop()


def _hold(release) -> str:
    """A command that runs until the test creates `release`."""
    return f"while [ ! -e {release} ]; do sleep 0.1; done"


class _Scenario:
    """4 GPUs. A holds 3 of them; B (4 GPUs, time limit 2 minutes) arrives, then short
    jobs C1-C4 (1 GPU, 1 minute). C1 starts at once on the free GPU (shortest first, and B
    could not start anyway); C2-C4 find no free GPU. Then A ends: FIFO would start B now.
    (Under plain shortest-first, the `sjf` preset, both tests fail: C2-C4 take A's GPUs.)"""

    def __init__(self, server: Server, c1_preemptible: bool) -> None:
        self.team = server.tenant("due")
        area = server.area(self.team)
        self.release_a, self.release_c1 = area / "release-a", area / "release-c1"
        self.a = self.submit("a", 3, _hold(self.release_a), preemptible=False, limit="10m")
        wait_state(self.team, self.a, "RUNNING")
        self.b = self.submit("b", 4, "sleep 1", preemptible=False, limit="2m")
        c1 = f"sleep {HOLD_SHORT}" if c1_preemptible else _hold(self.release_c1)
        self.c1 = self.submit("c1", 1, c1, preemptible=c1_preemptible)
        wait_state(self.team, self.c1, "RUNNING")
        self.shorts = [self.submit(f"c{i}", 1, f"sleep {HOLD_SHORT}") for i in (2, 3, 4)]
        # B does not fit and is not due (A's estimated end is 10 minutes away), the short
        # jobs find no free GPU: a pass explains why each waits
        waiting = (self.b, *self.shorts)
        wait_for(lambda: all(self.job(j)["reason"] for j in waiting))
        assert {self.job(j)["state"] for j in waiting} == {"PENDING"}
        self.release_a.touch()
        self.done_a = wait_state(self.team, self.a, "SUCCEEDED")

    def submit(self, name: str, gpus: int, command: str, preemptible: bool = True,
               limit: str = "1m") -> int:  # fmt: skip
        """A job whose time limit (its estimate) is `limit`."""
        spec = {"name": name, "gpus": gpus, "time_limit": limit, "command": command}
        return self.team.post("/jobs", {**spec, "preemptible": preemptible})["id"]

    def job(self, job_id: int) -> dict:
        return self.team.get(f"/jobs/{job_id}")

    def held(self) -> list[dict] | None:
        """The short jobs once a pass said they wait for B's reservation, or once one of
        them started; None before."""
        shorts = [self.job(j) for j in self.shorts]
        if any(j["started_at"] for j in shorts):
            return shorts
        return shorts if all(j["reason"] == Wait.RESERVED for j in shorts) else None

    def not_overtaken(self, done_b: dict) -> None:
        """No short job started before B ended (none overtook it, none ran beside it)."""
        for j in self.shorts:
            started = wait_for(lambda j=j: self.job(j)["started_at"])
            assert started >= done_b["finished_at"], f"job {j} started {started}, B {done_b}"

    def close(self) -> None:
        for j in (self.c1, *self.shorts):
            if self.job(j)["state"] in ("PENDING", "RUNNING"):
                self.team.post(f"/jobs/{j}/cancel")


def _late(start: float, since: float, what: str) -> None:
    late = start - since
    assert late < MARGIN, f"B started {late:.1f} s after {what}"


def test_a_due_job_preempts_the_later_arrivals_that_overtook_it(server):
    """In the pass that sees A's exit the virtual FIFO makes B due: B starts then, and C1,
    which arrived after it, is preempted for it (shortest-first alone would fill the 3
    free GPUs with C2-C4, and B would wait for them)."""
    run = _Scenario(server, c1_preemptible=True)
    try:
        done_b = wait_state(run.team, run.b, "SUCCEEDED", timeout=HOLD_SHORT + 30)
        _late(done_b["started_at"], run.done_a["finished_at"], "A ended")
        run.not_overtaken(done_b)
        c1 = run.job(run.c1)
        assert c1["preemptions"] == 1
        why = [e["reason"] for e in c1["events"] if e["to_state"] == "PREEMPTED"]
        assert why == [f"preempted for job-{run.b}, which has waited its turn (the wait guard)"]
    finally:
        run.close()


def test_a_due_job_that_may_not_preempt_holds_its_gpus_until_they_are_free(server):
    """C1 is not preemptible (live jobs are not, unless they say so): the due B cannot stop
    it, and holds the 3 GPUs A freed for itself; C2-C4 wait behind it, and B starts when
    C1 ends."""
    run = _Scenario(server, c1_preemptible=False)
    try:
        assert not any(j["started_at"] for j in wait_for(run.held)), "a short job overtook B"
        assert run.job(run.b)["state"] == "PENDING"
        run.release_c1.touch()
        done_c1 = wait_state(run.team, run.c1, "SUCCEEDED")
        done_b = wait_state(run.team, run.b, "SUCCEEDED")
        _late(done_b["started_at"], done_c1["finished_at"], "C1 ended")
        run.not_overtaken(done_b)
        assert run.job(run.c1)["preemptions"] == 0
    finally:
        run.close()
