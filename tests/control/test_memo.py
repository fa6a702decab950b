"""db.Memo on a real store, SQLite and PostgreSQL: what a batch of submissions reads once
per second at most (GPUs per pool, a tenant's quotas, which tenants have budgets) changes
at once when this process changes it, and within the memo's second when another does."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select

from gpucloud.control import db
from gpucloud.control.auth import KeyCache, Principal
from gpucloud.control.executors.base import NodeInfo
from gpucloud.control.models import Node
from gpucloud.control.services import capacity, nodes, tenants
from gpucloud.errors import CapacityError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(db_url):
    store = db.open_store(db_url)
    yield store
    store.close()


@pytest.fixture
def admin(store) -> Principal:
    with store.transaction() as s:
        key = tenants.bootstrap(s)
    return KeyCache(store).principal(key)


def _node(name: str, gpus: int) -> NodeInfo:
    return NodeInfo(name, "L4", gpus, "cuda", "127.0.0.1")


def _sync(store: db.Store, *infos: NodeInfo) -> None:
    with store.transaction() as s:
        nodes.sync(s, list(infos), time.time(), timeout=float("inf"))


def _admit(store: db.Store, who: Principal, gpus: int) -> None:
    with store.transaction() as s:
        capacity.check_admissible(s, who.tenant_id, capacity.Request.of(gpus, None, 0, 0))


def test_a_node_joining_through_this_process_is_seen_by_the_next_admission(store, admin):
    _sync(store, _node("a", 2))
    _admit(store, admin, 2)  # read, and kept
    with pytest.raises(CapacityError, match="4 GPUs of any type can never run here"):
        _admit(store, admin, 4)
    _sync(store, _node("a", 2), _node("b", 4))
    _admit(store, admin, 4)


def test_a_quota_set_through_the_services_holds_at_once(store, admin):
    _sync(store, _node("a", 4))
    _admit(store, admin, 4)
    with store.transaction() as s:
        tenants.set_quota(s, admin, admin.tenant_name, "L4", 1)
    with pytest.raises(CapacityError, match="exceed your tenant's quota"):
        _admit(store, admin, 4)


def _count(store: db.Store, memo: db.Memo) -> int:
    with store.reading() as s:
        return memo.get(s, None, lambda: s.scalar(select(func.count()).select_from(Node)))


def test_a_change_made_elsewhere_is_seen_once_the_memo_expires(store, db_url):
    clock = Clock()
    memo = db.Memo(store, (Node,), ttl=1.0, clock=clock)
    assert _count(store, memo) == 0
    other = db.open_store(db_url)  # another process's store: its commits are not watched
    _sync(other, _node("x", 1))
    other.close()
    clock.now += 0.9
    assert _count(store, memo) == 0  # within the stated second
    clock.now += 0.1
    assert _count(store, memo) == 1


def test_a_session_reads_its_own_changes_past_the_memo(store):
    memo = db.Memo(store, (Node,), ttl=60.0, clock=Clock())
    assert _count(store, memo) == 0
    with pytest.raises(RuntimeError), store.transaction() as s:
        nodes.sync(s, [_node("a", 1)], time.time(), timeout=float("inf"))
        s.flush()
        read = lambda: s.scalar(select(func.count()).select_from(Node))  # noqa: E731
        assert memo.get(s, None, read) == 1  # its own node, not the kept 0
        raise RuntimeError("rolled back")
    assert _count(store, memo) == 0  # the rolled-back read was not kept
