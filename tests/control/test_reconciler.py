"""The reconciler in-process on a real store: it knows when nothing is in flight (its loop
then rests until an API call wakes it) and when something is, down to a backoff begun in
the very pass that ended the job."""

from __future__ import annotations

import time

from gpucloud.control import server
from gpucloud.control.auth import authenticate
from gpucloud.control.config import Settings
from gpucloud.control.lifecycle import JobState
from gpucloud.control.models import Deployment, Job
from gpucloud.control.reconciler import Reconciler
from gpucloud.control.schemas import DeploymentSpec, JobSpec
from gpucloud.control.services import deployments, jobs


def _until(rec: Reconciler, store, done, timeout: float = 30.0) -> None:
    """Run passes until `done(session)` holds after one."""
    deadline = time.monotonic() + timeout
    while True:
        rec.reconcile()
        with store.reading() as s:
            if done(s):
                return
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_idle_only_when_nothing_runs_waits_or_backs_off(db_url, tmp_path):
    settings = Settings(
        home=tmp_path, db_url=db_url, virtual_gpus=2, node_name="n1", retry_backoff=60.0,
        grace_seconds=2.0,
    )  # fmt: skip
    store, key = server.prepare(settings)
    rec = Reconciler(store, settings)
    try:
        rec.reconcile()
        assert rec.idle  # an empty cluster
        with store.transaction() as s:
            who = authenticate(s, key)
            job = jobs.submit(s, who, JobSpec(name="j", command="exit 3", gpus=1, max_retries=1))
        rec.reconcile()
        assert not rec.idle  # it was queued (and is now started)
        _until(rec, store, lambda s: s.get(Job, job.id).state != JobState.RUNNING)
        with store.reading() as s:
            assert s.get(Job, job.id).state == JobState.RETRYING
        assert not rec.idle  # the pass that failed it knows it backs off for 60 s
        rec.reconcile()
        assert not rec.idle
        with store.transaction() as s:
            jobs.cancel(s, who, job.id)
        rec.reconcile()
        assert rec.idle

        spec = DeploymentSpec(name="m", model_dir="/m", replicas=1, command="sleep 30")
        with store.transaction() as s:
            deployments.create(s, who, spec)
        rec.reconcile()
        assert not rec.idle  # a replica starting
        rec.reconcile()
        assert not rec.idle  # and not ready: it is probed on every pass
        with store.transaction() as s:
            deployments.delete(s, who, "m")
        _until(rec, store, lambda s: s.query(Deployment).one().state == deployments.DELETED)
        rec.reconcile()
        assert rec.idle
    finally:
        rec.stop()
        store.close()
