"""The store's migrations: revision 0001 upgraded to head keeps every row (and rows of later
tables from the revision that added them), on SQLite and PostgreSQL, and the head schema is
exactly what the models declare."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from gpucloud.control import db
from gpucloud.control.auth import authenticate, hash_key
from gpucloud.control.models import Base

ROWS = [
    "INSERT INTO tenants (id, name, is_operator, created_at) VALUES (1, 'acme', false, 1.5)",
    "INSERT INTO users (id, tenant_id, name, role, created_at) VALUES (1, 1, 'ann', 'admin', 2.5)",
    "INSERT INTO api_keys (id, user_id, prefix, key_hash, created_at) "
    "VALUES (1, 1, 'gpc_abc', 'f00d', 3.5)",
    "INSERT INTO nodes (id, name, gpu_type, gpus, link_domain, backend, labels, state, "
    "heartbeat_at, created_at) VALUES (1, 'n1', 'L4', 4, 1, 'cpu', '{}', 'ready', 4.5, 4.5)",
    "INSERT INTO jobs (id, tenant_id, user_id, name, command, gpus, priority, preemptible, "
    "max_retries, env, state, attempts, devices, not_before, cancel_requested, submitted_at) "
    "VALUES (7, 1, 1, 'train', 'sleep 1', 2, 'normal', false, 1, '{}', 'SUCCEEDED', 1, '[]', "
    "0, false, 5.5)",
    "INSERT INTO job_events (job_id, at, to_state) VALUES (7, 5.5, 'PENDING')",
]
ROWS_0004 = [
    "INSERT INTO deployments (id, tenant_id, user_id, name, model_dir, engine_args, replicas, "
    "gpus_per_replica, priority, preemptible, env, state, created_at, cpu_milli, memory_mib) "
    "VALUES (3, 1, 1, 'chat', '/m', '[]', 1, 1, 'high', false, '{}', 'active', 6.5, 0, 0)",
    'INSERT INTO replicas (id, deployment_id, "index", state, devices, restarts, exit_code, '
    "not_before, created_at) VALUES (4, 3, 0, 'RESTARTING', '[]', 2, 137, 7.5, 6.5)",
    # The replica's GPU time: the migrations that rebuild `replicas` (SQLite's ALTER TABLE)
    # must keep what refers to it.
    "INSERT INTO usage (tenant_id, replica_id, gpu_type, gpus, started_at, ended_at) "
    "VALUES (1, 4, 'H100-SXM', 1, 6.5, 7.5)",
]


def test_upgrade_from_revision_1_keeps_rows(db_url):
    engine = db.make_engine(db_url)
    db.upgrade(engine, "0001")
    assert db.current_revision(engine) == "0001"
    with engine.begin() as conn:
        for sql in ROWS:
            conn.execute(text(sql))
    db.upgrade(engine, "0004")
    with engine.begin() as conn:
        for sql in ROWS_0004:
            conn.execute(text(sql))
    db.upgrade(engine)
    assert db.current_revision(engine) == "0022"
    with engine.connect() as conn:
        tenant = conn.execute(text("SELECT name, weight, created_at FROM tenants")).one()
        job = conn.execute(
            text(
                "SELECT name, state, gpus, preemptions, cpu_milli, memory_mib, time_limit, "
                "gpu_milli FROM jobs"
            )
        ).one()
        node = conn.execute(text("SELECT gpus, cpu_milli, memory_mib FROM nodes")).one()
        events = conn.execute(text("SELECT count(*) FROM job_events")).scalar()
        used = conn.execute(text("SELECT replica_id, gpus FROM usage")).one()
        key = conn.execute(text("SELECT key_hash FROM api_keys")).scalar()
        replica = conn.execute(text("SELECT state, restarts, exit_code, reason FROM replicas"))
        replica = replica.one()
        version = conn.execute(
            text(
                "SELECT v.number, v.model_dir, v.state, v.percent FROM replicas r "
                "JOIN deployment_versions v ON r.version_id = v.id"
            )
        ).one()
    assert tuple(tenant) == ("acme", 1.0, 1.5)  # new column filled with its default
    # no CPU, memory or time limit; whole GPUs
    assert tuple(job) == ("train", "SUCCEEDED", 2, 0, 0, 0, None, 1000)
    assert tuple(node) == (4, 0, 0)  # host resources not tracked until it registers again
    assert events == 1 and key == "f00d"
    assert tuple(used) == (4, 1)
    assert tuple(replica) == ("RESTARTING", 2, 137, None)  # why it failed: not known before 0005
    assert tuple(version) == (1, "/m", "stable", 100)  # a deployment's version 1 since 0013
    engine.dispose()


def test_upgrade_keeps_existing_keys_working(db_url):
    """Keys issued before keys had names (revision 0004) still authenticate, named after
    their user; they were hashed already, so no secret is in the table before or after."""
    engine = db.make_engine(db_url)
    db.upgrade(engine, "0004")
    key = "gpc_issued-before-0006"
    with engine.begin() as conn:
        for sql in ROWS[:2]:
            conn.execute(text(sql))
        conn.execute(
            text(
                "INSERT INTO api_keys (user_id, prefix, key_hash, created_at) "
                "VALUES (1, :prefix, :hash, 3.5)"
            ),
            {"prefix": key[:10], "hash": hash_key(key)},
        )
    engine.dispose()
    store = db.open_store(db_url)  # upgrades to head
    with store.reading() as session:
        who = authenticate(session, key)
    with store.engine.connect() as conn:
        stored = conn.execute(text("SELECT name, key_hash, last_used_at, expires_at FROM api_keys"))
        row = tuple(stored.one())
    store.close()
    assert (who.tenant_name, who.user_name, who.role) == ("acme", "ann", "admin")
    assert row == ("ann", hash_key(key), None, None)


def test_head_schema_matches_models(db_url):
    store = db.open_store(db_url)
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    store.close()


def test_bad_database_url_names_the_allowed_ones():
    import pytest

    from gpucloud.errors import ConfigError

    with pytest.raises(ConfigError, match="sqlite:///PATH or postgresql://"):
        db.make_engine("mysql://root@localhost/x")
