"""The store: one SQLAlchemy engine (SQLite in WAL mode, or PostgreSQL) and its migrations.

`open_store(url)` upgrades the schema to the newest Alembic revision before returning, so
a control plane started on an older database keeps every row and gains the new columns.
"""

from __future__ import annotations

import asyncio
import itertools
import select as select_
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Generic, TypeVar

from psycopg.pq import ConnStatus
from sqlalchemy import Connection, Engine, Table, create_engine, event, func, select
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

from gpucloud.errors import ConfigError

MIGRATIONS = Path(__file__).parent / "migrations"
_SCHEMES = ("sqlite", "postgresql")


def normalize_url(url: str) -> str:
    """A SQLAlchemy URL for `url`: PostgreSQL through psycopg 3, SQLite as given.

    Raises ConfigError for any other database.
    """
    scheme = url.split(":", 1)[0].split("+", 1)[0]
    if scheme not in _SCHEMES or "://" not in url:
        raise ConfigError(
            f"unsupported database URL {url!r}: use sqlite:///PATH or postgresql://USER@HOST/DB"
        )
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_engine(url: str) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        # The API's worker threads and the reconciler thread share the engine.
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _begin_immediate)
        return engine
    engine = create_engine(url, pool_size=10, max_overflow=20)
    event.listen(engine, "checkout", _refuse_closed)
    return engine


def _refuse_closed(dbapi_conn, _record, _proxy) -> None:
    """Have the pool replace a PostgreSQL connection the server has closed (restarted,
    terminated its backend) before handing it out.

    The server sends nothing unasked to an idle connection that does not LISTEN, except when
    it ends it (its error message, then EOF): if the socket has something to read, it is
    closed. SQLAlchemy's pre-ping asked with a `SELECT 1`, a round trip on every checkout:
    one of the seven of a batch of submissions, each of which waits for the GIL behind the
    API's event loop and the reconciler (benchmarks/control_plane.py).
    """
    pgconn = dbapi_conn.pgconn
    if pgconn.status != ConnStatus.OK or select_.select([pgconn.socket], [], [], 0)[0]:
        raise DisconnectionError("the server closed the connection")


def new_ids(conn: Connection, table: Table, count: int) -> list[int]:
    """The ids of `count` rows about to be inserted into `table` (whose primary key is an
    integer `id`) by `conn`'s write transaction, in one statement, so that the rows can go
    in one executemany that returns nothing.

    On PostgreSQL they are drawn from the table's sequence; on SQLite they follow the
    largest id (as SQLite's own would), which no other writer can take meanwhile: the
    transaction holds the database's one write lock (BEGIN IMMEDIATE). An INSERT ...
    RETURNING that must give the ids in the rows' order went one row per statement
    (SQLAlchemy's insertmanyvalues, on PostgreSQL kept to 50 parameters so that psycopg
    keeps its parse): each statement is a round trip to PostgreSQL, and each lets go of the
    GIL and waits to get it back behind the API's event loop, while the batches of
    submissions commit one at a time.
    """
    if conn.dialect.name == "postgresql":
        sequence = func.pg_get_serial_sequence(table.name, "id")
        draw = select(func.nextval(sequence)).select_from(func.generate_series(1, count))
        return list(conn.execute(draw).scalars())
    first = conn.scalar(select(func.coalesce(func.max(table.c.id), 0))) + 1
    return list(range(first, first + count))


def unread(conn: Connection) -> AbstractContextManager:
    """A block of statements whose results are not read (inserts, updates): on PostgreSQL
    they go to the server together when it ends, in one round trip (psycopg's pipeline
    mode), and an error among them is raised there; in `Store.unread_writes` they are one
    transaction. No statement in it may be read from: SQLAlchemy reads a result's columns
    as soon as it executes the statement."""
    if conn.dialect.name != "postgresql":
        return nullcontext()
    return conn.connection.driver_connection.pipeline()


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()
    dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)


def _begin_immediate(conn) -> None:
    # Take the write lock when a transaction starts: a deferred transaction that reads and
    # then writes fails at once (SQLITE_BUSY, no waiting) when another writer came first.
    # Read-only transactions begin deferred: in WAL mode they never wait for the writer.
    readonly = conn.get_execution_options().get("gpucloud_readonly", False)
    conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")


def alembic_config(engine: Engine):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema up to `revision` (the newest by default); rows are kept."""
    from alembic import command

    command.upgrade(alembic_config(engine), revision)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


class Store:
    """The engine plus a session factory; `transaction()` is the only way code writes."""

    def __init__(self, engine: Engine):
        self.engine = engine
        # SQLite has one writer at a time and its waiters poll with sleeps, so under load
        # some wait for seconds: queue this process's writers on a lock instead.
        self._write_lock = threading.Lock() if engine.dialect.name == "sqlite" else nullcontext()
        self._sessions = sessionmaker(engine, expire_on_commit=False, info={"store": self})
        # A read transaction sees one snapshot (SQLite's WAL readers do): under PostgreSQL's
        # default READ COMMITTED each statement saw the newest commits, so the reconciler
        # read a job submitted between two of its queries as pending and not held by a
        # spent budget, and started it.
        snapshot = {"isolation_level": "REPEATABLE READ"} if engine.dialect.name != "sqlite" else {}
        self._readers = sessionmaker(
            engine.execution_options(gpucloud_readonly=True, **snapshot),
            expire_on_commit=False,
            info={"store": self},
        )
        # PostgreSQL: each statement, or each `unread` block, a transaction of its own.
        self._batches = self._sessions
        if engine.dialect.name == "postgresql":
            self._batches = sessionmaker(
                engine.execution_options(isolation_level="AUTOCOMMIT"),
                expire_on_commit=False,
                info={"store": self},
            )
        self._memos: dict[str, Memo] = {}
        self._memos_lock = threading.Lock()

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session whose changes commit together when the block ends (rolled back on error)."""
        with self._write_lock, self._sessions.begin() as session:
            yield session

    @contextmanager
    def unread_writes(self) -> Iterator[Session]:
        """A session for reads, then writes that read nothing back (a batch of submissions):
        on SQLite a `transaction()`; on PostgreSQL its statements commit one by one, except
        those of a `unread` block, which commit together, in the block's one round trip.

        A transaction on PostgreSQL costs two round trips of its own, BEGIN and COMMIT: in
        the block's implicit transaction (all that comes before a Sync, in pipeline mode) a
        batch of submissions is two round trips, its ids drawn then its rows written.
        """
        with self._write_lock, self._batches.begin() as session:
            yield session

    @contextmanager
    def reading(self) -> Iterator[Session]:
        """A session for reads only: on SQLite it does not take the write lock."""
        with self._readers.begin() as session:
            yield session

    def listen(self, identifier: str, fn: Callable) -> None:
        """Call `fn` on the session event `identifier` of this store's writing sessions."""
        for sessions in {self._sessions, self._batches}:
            event.listen(sessions, identifier, fn)

    def watch(self, models: tuple[type, ...], on_commit: Callable[[], None]) -> Callable:
        """Call `on_commit` after each transaction of this store that added, changed or
        deleted an ORM object of `models` commits. Bulk statements are not seen.

        Returns `changing(session)`: whether that session has such changes not committed."""
        mark = f"gpucloud_changed_{next(_WATCHES)}"

        def changing(session: Session) -> bool:
            pending = (*session.new, *session.dirty, *session.deleted)
            return session.info.get(mark, False) or any(isinstance(o, models) for o in pending)

        def flushed(session: Session, _context) -> None:
            if changing(session):
                session.info[mark] = True

        def committed(session: Session) -> None:
            if session.info.pop(mark, False):
                on_commit()

        self.listen("after_flush", flushed)
        self.listen("after_commit", committed)
        self.listen("after_rollback", lambda session: session.info.pop(mark, None))
        return changing

    def memo(self, name: str, models: tuple[type, ...], ttl: float) -> Memo:
        """This store's Memo called `name` (made on first use)."""
        with self._memos_lock:
            if name not in self._memos:
                self._memos[name] = Memo(self, models, ttl)
            return self._memos[name]

    def close(self) -> None:
        self.engine.dispose()


_WATCHES = itertools.count()
Value = TypeVar("Value")


class Memo(Generic[Value]):
    """A value read from the store, kept for requests that would each read it again (the
    GPUs per pool for every batch of submissions, say) until this process commits a change
    to one of `models`, and for `ttl` seconds at most: changes made elsewhere (another
    process, a bulk statement) are seen that late.

    A read that began before such a commit does not keep its (perhaps older) value, and a
    session with its own changes to `models` reads past the memo."""

    def __init__(
        self,
        store: Store,
        models: tuple[type, ...],
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.clock = clock
        self._values: dict[Any, tuple[Value, float]] = {}  # key -> (value, expiry)
        self._generation = 0
        self._lock = threading.Lock()
        self._changing = store.watch(models, self.clear)

    def get(self, session: Session, key: Any, read: Callable[[], Value]) -> Value:
        """The value kept for `key`, or `read()`'s (then kept); `session` is the reader's."""
        if self._changing(session):
            return read()
        hit = self._values.get(key)
        if hit is not None and hit[1] > self.clock():
            return hit[0]
        generation = self._generation
        value = read()
        with self._lock:
            if generation == self._generation:
                self._values[key] = (value, self.clock() + self.ttl)
        return value

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._generation += 1


def memo(
    session: Session, name: str, models: tuple[type, ...], key: Any, read: Callable[[], Value]
) -> Value:
    """`read()`, or the value it gave for `key` that the store's Memo `name` (made on first
    use, kept for a second at most) still keeps: see `Memo`."""
    return session.info["store"].memo(name, models, ttl=1.0).get(session, key, read)


Item = TypeVar("Item")
Result = TypeVar("Result")


class GroupCommit(Generic[Item, Result]):
    """Writes from concurrent requests, committed together (group commit).

    `await group(item)` queues `item`; while one batch commits in a worker thread, the next
    ones queue, and the batch after takes them all (at most `limit`). One transaction, one
    commit and one thread hop per batch instead of per request: on SQLite, whose one writer
    makes every write transaction wait for the previous one, the statements and the commit
    are what a request held the lock for; on PostgreSQL, a commit is a round trip and a WAL
    flush. There is no timer: a request that finds no batch committing starts one at once,
    so a lone request waits for nothing.

    `write(session, items)` returns one result per item, in order: a value, or the
    exception to raise in that item's request (a refused item must not fail the others).
    If the transaction itself fails, each item is retried in a transaction of its own, so
    only the item at fault gets the error. `unread`: `write` writes only in one `unread`
    block, after its reads, and runs in `Store.unread_writes` (on PostgreSQL, no BEGIN and
    COMMIT of their own).
    """

    def __init__(
        self,
        store: Store,
        write: Callable[[Session, list[Item]], list[Result | Exception]],
        limit: int = 256,
        unread: bool = False,
    ) -> None:
        self.store = store
        self.write = write
        self.limit = limit
        self._session = store.unread_writes if unread else store.transaction
        self._queue: list[tuple[Item, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None

    async def __call__(self, item: Item) -> Result:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._queue.append((item, done))
        d = self._drainer
        if d is None or d.done() or d.get_loop() is not loop:
            self._drainer = loop.create_task(self._drain())
        return await done

    async def _drain(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self.limit], self._queue[self.limit :]
            try:
                results = await asyncio.to_thread(self._commit, [item for item, _ in batch])
            except Exception as e:  # every waiter of the batch gets it
                results = [e] * len(batch)
            for (_, done), result in zip(batch, results, strict=True):
                if done.done():  # the request was cancelled (its client went away)
                    continue
                if isinstance(result, Exception):
                    done.set_exception(result)
                else:
                    done.set_result(result)

    def _commit(self, items: list[Item]) -> list[Result | Exception]:
        try:
            with self._session() as session:
                return self.write(session, items)
        except Exception as e:
            if len(items) == 1:
                return [e]
        return [r for item in items for r in self._commit([item])]


def open_store(url: str) -> Store:
    """Connect to `url`, migrate it to the newest schema and return the store."""
    engine = make_engine(url)
    upgrade(engine)
    return Store(engine)
