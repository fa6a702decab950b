"""Workloads are known to their executor by a handle token (no longer a local pid) and may
span several nodes (their placement); nodes have an address, and say since when and why
they are in their state.

Revision ID: 0008
Revises: 0007
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"

_WORKLOADS = ("jobs", "replicas")


def upgrade() -> None:
    for table in _WORKLOADS:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("handle", sa.String(255), nullable=True))
            batch.add_column(sa.Column("placement", sa.JSON, nullable=False, server_default="[]"))
            if table == "replicas":  # where the gateway reaches it: its node's address
                batch.add_column(sa.Column("url", sa.String(255), nullable=True))
        _copy_local_handles(table)
        # ALTER TABLE ... DROP COLUMN in place (SQLite >= 3.35): copying the table, as batch
        # mode would, trips the foreign keys that point at it.
        with op.batch_alter_table(table, recreate="never") as batch:
            batch.drop_column("pid")
            batch.drop_column("pid_start_time")
    with op.batch_alter_table("jobs") as batch:  # attempts lost by the platform: no retry used
        batch.add_column(sa.Column("requeues", sa.Integer, nullable=False, server_default="0"))
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(
            sa.Column("address", sa.String(255), nullable=False, server_default="127.0.0.1")
        )
        batch.add_column(sa.Column("reason", sa.Text, nullable=True))
        batch.add_column(sa.Column("state_since", sa.Float, nullable=True))


def _copy_local_handles(table: str) -> None:
    """A workload running under the local executor keeps running: its handle is its pid and
    start time, its placement its one node, a replica's URL on 127.0.0.1."""
    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            f"SELECT w.id, w.pid, w.pid_start_time, n.name, w.devices FROM {table} w "
            "JOIN nodes n ON n.id = w.node_id WHERE w.pid IS NOT NULL"
        )
    ).all()
    if table == "replicas":
        conn.execute(
            sa.text(
                "UPDATE replicas SET url = 'http://127.0.0.1:' || CAST(port AS VARCHAR(8)) "
                "WHERE port IS NOT NULL"
            )
        )
    for wid, pid, started, node, devices in rows:
        if isinstance(devices, str):  # SQLite hands JSON back as text
            devices = json.loads(devices)
        conn.execute(
            sa.text(f"UPDATE {table} SET handle = :h, placement = :p WHERE id = :id"),
            {
                "h": f"{pid}:{started!r}",
                "p": json.dumps([{"node": node, "devices": list(devices or [])}]),
                "id": wid,
            },
        )


def downgrade() -> None:
    with op.batch_alter_table("nodes", recreate="never") as batch:
        batch.drop_column("state_since")
        batch.drop_column("reason")
        batch.drop_column("address")
    with op.batch_alter_table("jobs", recreate="never") as batch:
        batch.drop_column("requeues")
    for table in _WORKLOADS:
        with op.batch_alter_table(table, recreate="never") as batch:
            batch.add_column(sa.Column("pid", sa.Integer, nullable=True))
            batch.add_column(sa.Column("pid_start_time", sa.Float, nullable=True))
            batch.drop_column("placement")
            if table == "replicas":
                batch.drop_column("url")
            batch.drop_column("handle")
