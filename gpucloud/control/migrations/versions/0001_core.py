"""Tenants, users, API keys, quotas, nodes, jobs, job events and the audit log.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def _id() -> sa.Column:
    return sa.Column("id", sa.Integer, primary_key=True)


def upgrade() -> None:
    op.create_table(
        "tenants",
        _id(),
        sa.Column("name", sa.String(63), nullable=False, unique=True),
        sa.Column("is_operator", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "users",
        _id(),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False, index=True),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.UniqueConstraint("tenant_id", "name"),
    )
    op.create_table(
        "api_keys",
        _id(),
        sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id"), nullable=False, index=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("revoked_at", sa.Float),
    )
    op.create_table(
        "quotas",
        _id(),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False, index=True),
        sa.Column("gpu_type", sa.String(32), nullable=False),
        sa.Column("gpus", sa.Integer, nullable=False),
        sa.UniqueConstraint("tenant_id", "gpu_type"),
    )
    op.create_table(
        "nodes",
        _id(),
        sa.Column("name", sa.String(63), nullable=False, unique=True),
        sa.Column("gpu_type", sa.String(32), nullable=False),
        sa.Column("gpus", sa.Integer, nullable=False),
        sa.Column("link_domain", sa.Integer, nullable=False),
        sa.Column("backend", sa.String(16), nullable=False),
        sa.Column("labels", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "jobs",
        _id(),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False, index=True),
        sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id"), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("command", sa.Text),
        sa.Column("train_config", sa.Text),
        sa.Column("gpus", sa.Integer, nullable=False),
        sa.Column("gpu_type", sa.String(32)),
        sa.Column("priority", sa.String(16), nullable=False),
        sa.Column("preemptible", sa.Boolean, nullable=False),
        sa.Column("max_retries", sa.Integer, nullable=False),
        sa.Column("env", sa.JSON, nullable=False),
        sa.Column("workdir", sa.Text),
        sa.Column("checkpoint_dir", sa.Text),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("exit_code", sa.Integer),
        sa.Column("reason", sa.Text),
        sa.Column("node_id", sa.Integer, sa.ForeignKey("nodes.id")),
        sa.Column("devices", sa.JSON, nullable=False),
        sa.Column("pid", sa.Integer),
        sa.Column("pid_start_time", sa.Float),
        sa.Column("log_path", sa.Text),
        sa.Column("not_before", sa.Float, nullable=False),
        sa.Column("cancel_requested", sa.Boolean, nullable=False),
        sa.Column("submitted_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float),
    )
    op.create_table(
        "job_events",
        _id(),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), nullable=False, index=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("from_state", sa.String(16)),
        sa.Column("to_state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text),
    )
    op.create_table(
        "audit_log",
        _id(),
        sa.Column("at", sa.Float, nullable=False, index=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id")),
        sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id")),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(128), nullable=False),
        sa.Column("detail", sa.JSON, nullable=False),
    )


def downgrade() -> None:
    for table in ("audit_log", "job_events", "jobs", "nodes", "quotas", "api_keys", "users"):
        op.drop_table(table)
    op.drop_table("tenants")
