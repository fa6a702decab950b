"""Idle reclaim (a TTL on deployments without traffic and on interactive jobs, a tenant's
default), labels on deployments, a stop's own reason, and the budget periods whose
threshold crossings were audited.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("idle_ttl", sa.Float(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("stop_reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("interactive", sa.Boolean(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("idle_ttl", sa.Float(), nullable=True))
        batch.add_column(sa.Column("idle_reclaim_at", sa.Float(), nullable=True))
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("labels", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("idle_ttl", sa.Float(), nullable=True))
        batch.add_column(sa.Column("idle_reclaim_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("reclaimed_replicas", sa.Integer(), nullable=True))
    with op.batch_alter_table("budgets") as batch:
        batch.add_column(sa.Column("soft_audited", sa.String(7), nullable=False, server_default=""))
        batch.add_column(
            sa.Column("exhausted_audited", sa.String(7), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("budgets") as batch:
        batch.drop_column("exhausted_audited")
        batch.drop_column("soft_audited")
    with op.batch_alter_table("deployments") as batch:
        for column in ("reclaimed_replicas", "idle_reclaim_at", "idle_ttl", "labels"):
            batch.drop_column(column)
    with op.batch_alter_table("jobs") as batch:
        for column in ("idle_reclaim_at", "idle_ttl", "interactive", "stop_reason"):
            batch.drop_column(column)
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("idle_ttl")
