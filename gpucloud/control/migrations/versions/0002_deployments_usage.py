"""Deployments and their replicas, usage accounting, tenant weights and job preemption counts.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("weight", sa.Float, nullable=False, server_default="1.0"))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("preemptions", sa.Integer, nullable=False, server_default="0"))
    op.create_table(
        "deployments",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False, index=True),
        sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id"), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("model_dir", sa.Text, nullable=False),
        sa.Column("engine_args", sa.JSON, nullable=False),
        sa.Column("command", sa.Text),
        sa.Column("replicas", sa.Integer, nullable=False),
        sa.Column("gpus_per_replica", sa.Integer, nullable=False),
        sa.Column("gpu_type", sa.String(32)),
        sa.Column("priority", sa.String(16), nullable=False),
        sa.Column("preemptible", sa.Boolean, nullable=False),
        sa.Column("env", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "replicas",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "deployment_id",
            sa.Integer,
            sa.ForeignKey("deployments.id"),
            nullable=False,
            index=True,
        ),
        sa.Column("index", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("node_id", sa.Integer, sa.ForeignKey("nodes.id")),
        sa.Column("devices", sa.JSON, nullable=False),
        sa.Column("port", sa.Integer),
        sa.Column("pid", sa.Integer),
        sa.Column("pid_start_time", sa.Float),
        sa.Column("log_path", sa.Text),
        sa.Column("restarts", sa.Integer, nullable=False),
        sa.Column("exit_code", sa.Integer),
        sa.Column("not_before", sa.Float, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float),
        sa.Column("ready_at", sa.Float),
    )
    op.create_table(
        "usage",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False, index=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id")),
        sa.Column("replica_id", sa.Integer, sa.ForeignKey("replicas.id")),
        sa.Column("gpu_type", sa.String(32), nullable=False),
        sa.Column("gpus", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False, index=True),
        sa.Column("ended_at", sa.Float),
    )


def downgrade() -> None:
    op.drop_table("usage")
    op.drop_table("replicas")
    op.drop_table("deployments")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("preemptions")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("weight")
