"""The store: one SQLAlchemy engine (SQLite in WAL mode, or PostgreSQL) and its migrations.

`open_store(url)` upgrades the schema to the newest Alembic revision before returning, so
a control plane started on an older database keeps every row and gains the new columns.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
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
    return create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)


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
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._readers = sessionmaker(
            engine.execution_options(gpucloud_readonly=True), expire_on_commit=False
        )

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session whose changes commit together when the block ends (rolled back on error)."""
        with self._write_lock, self._sessions.begin() as session:
            yield session

    @contextmanager
    def reading(self) -> Iterator[Session]:
        """A session for reads only: on SQLite it does not take the write lock."""
        with self._readers.begin() as session:
            yield session

    def close(self) -> None:
        self.engine.dispose()


def open_store(url: str) -> Store:
    """Connect to `url`, migrate it to the newest schema and return the store."""
    engine = make_engine(url)
    upgrade(engine)
    return Store(engine)
