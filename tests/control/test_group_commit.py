"""db.GroupCommit on a real store, SQLite and PostgreSQL: concurrent writes share one
transaction; an item its write refuses gets its own error; a transaction that fails is
retried item by item, so only the item at fault fails."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest
from psycopg.pq import Trace
from sqlalchemy import create_engine, event, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

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


def test_an_unread_block_commits_all_of_its_statements_or_none(store):
    """On PostgreSQL, `unread_writes` has no transaction of its own: an `unread` block is
    one (what its Sync closes), whose failing statement takes the others back with it."""

    def add(names: list[str]) -> None:
        with store.unread_writes() as s:
            conn = s.connection()
            with db.unread(conn):
                for name in names:
                    row = {"name": name, "is_operator": False, "weight": 1.0, "created_at": 0.0}
                    conn.execute(insert(Tenant.__table__).inline(), [row])

    with pytest.raises((IntegrityError, psycopg.IntegrityError)):  # raised by the Sync
        add(["x", "y", "x"])
    add(["x", "z"])
    with store.reading() as s:
        assert sorted(s.scalars(select(Tenant.name))) == ["x", "z"]


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


# The reads of a batch that db.memo keeps (pools, quotas, budgeted tenants).
_MEMO_READS = ("SELECT nodes.gpu_type", "SELECT quotas.", "SELECT DISTINCT budgets.")


@pytest.fixture
def pg_store(postgres):
    store = db.open_store(postgres.new_database())
    yield store
    store.close()


def test_a_batch_of_submissions_is_two_round_trips_to_postgresql(pg_store, tmp_path):
    """The ids drawn, then the three INSERTs together in one implicit transaction
    (psycopg's pipeline mode, no BEGIN or COMMIT); no `SELECT 1` when the pool hands out
    the connection. Each round trip lets go of the
    GIL and waits to get it back behind the API's event loop and the reconciler. Counted
    from libpq's trace of what the client sent: a simple query or a Sync is one wait."""
    store = pg_store
    with store.transaction() as s:
        key = tenants.bootstrap(s)
        nodes.sync(s, [NodeInfo("n", "L4", 8, "cpu", "127.0.0.1", 8000, 8192, {})], 0.0, 1e9)
    with store.reading() as s:
        who = authenticate(s, key)
    group = db.GroupCommit(store, jobs.submit_many, unread=True)
    trace = (tmp_path / "trace").open("w")

    def traced(dbapi_conn, _record) -> None:
        dbapi_conn.pgconn.trace(trace.fileno())
        dbapi_conn.pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS)

    def waits(names: list[str]) -> int:
        trace.truncate(0)
        batch = [(who, JobSpec(name=n, command="true", gpus=1)) for n in names]
        results = asyncio.run(_submit_all(group, batch))
        assert [r.name for r in results] == names
        trace.flush()
        lines = (tmp_path / "trace").read_text().splitlines()
        sent = [(*line.split("\t")[2:4], "")[:2] for line in lines if line.startswith("F\t")]
        # A memo's value lasts a second: one that ran out meanwhile is read again.
        rereads = sum(
            1
            for kind, text in sent
            if kind in ("Parse", "Query") and text.lstrip(' "').startswith(_MEMO_READS)
        )
        sent = [kind for kind, _ in sent]
        return sent.count("Query") + sent.count("Sync") - rereads

    store.engine.dispose()  # connections made from here on are traced
    event.listen(store.engine, "connect", traced)
    assert waits(["first"]) == waits([f"many-{i}" for i in range(16)]) == waits(["one"]) == 2
    with store.reading() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 18


def test_a_connection_the_server_closed_is_replaced_before_use(pg_store):
    """The pool checks a connection's socket before handing it out, not with a round trip:
    after PostgreSQL ends every backend of the store's pool (as a restart would), the next
    transactions run on new connections."""
    store = pg_store
    held = [store.engine.connect() for _ in range(3)]  # three connections in the pool
    pids = [c.connection.driver_connection.info.backend_pid for c in held]
    for c in held:
        c.close()
    admin = create_engine(store.engine.url, poolclass=NullPool)  # not one of the pool's
    with admin.connect() as conn:
        for pid in pids:
            assert conn.scalar(select(func.pg_terminate_backend(pid)))
    admin.dispose()
    for i in range(4):
        with store.transaction() as s:
            s.add(Tenant(name=f"after-{i}", is_operator=False, weight=1.0, created_at=0.0))
    with store.reading() as s:
        assert len(s.scalars(select(Tenant).where(Tenant.name.like("after-%"))).all()) == 4
