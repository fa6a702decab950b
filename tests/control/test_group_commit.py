"""db.GroupCommit on a real store, SQLite and PostgreSQL: concurrent writes share one
transaction; an item its write refuses gets its own error; a transaction that fails is
retried item by item, so only the item at fault fails."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import event, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpucloud.control import db
from gpucloud.control.auth import authenticate
from gpucloud.control.executors.base import NodeInfo
from gpucloud.control.models import Job, Tenant
from gpucloud.control.schemas import JobSpec
from gpucloud.control.services import jobs, nodes, tenants
from gpucloud.errors import UserError


@pytest.fixture
def store(db_url):
    store = db.open_store(db_url)
    yield store
    store.close()


class TenantWriter:
    """Creates a tenant per item (names are unique in the table); refuses names starting
    with 'bad'; records the size of each batch it was given."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def __call__(self, session: Session, names: list[str]) -> list[int | Exception]:
        self.batches.append(len(names))
        out: list[int | Exception] = []
        for name in names:
            if name.startswith("bad"):
                out.append(UserError(f"refused {name}"))
                continue
            row = {"name": name, "is_operator": False, "weight": 1.0, "created_at": time.time()}
            out.append(session.scalar(insert(Tenant).values(row).returning(Tenant.id)))
        return out


async def _submit_all(group: db.GroupCommit, names: list[str]) -> list:
    return await asyncio.gather(*(group(n) for n in names), return_exceptions=True)


def test_concurrent_writes_commit_together_and_refusals_stay_with_their_item(store):
    writer = TenantWriter()
    group = db.GroupCommit(store, writer)
    assert isinstance(asyncio.run(_submit_all(group, ["alone"]))[0], int)
    names = [f"t{i}" for i in range(10)] + ["bad-1"]
    results = asyncio.run(_submit_all(group, names))
    assert writer.batches == [1, 11]  # a lone write waits for nothing; the rest went as one
    assert all(isinstance(r, int) for r in results[:10]) and len(set(results[:10])) == 10
    assert isinstance(results[10], UserError) and "bad-1" in str(results[10])
    with store.reading() as s:
        assert set(s.scalars(select(Tenant.name))) == {"alone", *names[:10]}


def test_a_failed_transaction_is_retried_item_by_item(store):
    writer = TenantWriter()
    group = db.GroupCommit(store, writer)
    results = asyncio.run(_submit_all(group, ["a", "b", "a", "c"]))  # the second 'a' clashes
    assert writer.batches == [4, 1, 1, 1, 1]
    assert [type(r) for r in results] == [int, int, IntegrityError, int]
    with store.reading() as s:
        assert sorted(s.scalars(select(Tenant.name))) == ["a", "b", "c"]


def test_a_batch_of_submissions_inserts_in_as_many_statements_as_one_submission(store):
    """Each statement is a round trip to PostgreSQL, and batches commit one at a time: a
    batch's jobs go in one executemany (their ids drawn first), not a statement per job
    (SQLAlchemy's INSERT ... RETURNING in the rows' order). Each job gets its row's id."""
    with store.transaction() as s:
        key = tenants.bootstrap(s)
        nodes.sync(s, [NodeInfo("n", "L4", 8, "cpu", "127.0.0.1", 8000, 8192, {})], 0.0, 1e9)
    inserts = []

    def count(_conn, _cursor, statement: str, *_args) -> None:
        inserts.append(statement.startswith("INSERT"))

    event.listen(store.engine, "before_cursor_execute", count)

    def submit(names: list[str]) -> int:
        inserts.clear()
        with store.transaction() as s:
            who = authenticate(s, key)
            batch = [(who, JobSpec(name=n, command="true", gpus=1)) for n in names]
            submitted = jobs.submit_many(s, batch)
        statements = sum(inserts)
        with store.reading() as s:
            assert [s.get(Job, j.id).name for j in submitted] == names
        return statements

    assert submit([f"many-{i}" for i in range(16)]) == submit(["one"]) == 3  # jobs, events, audit
