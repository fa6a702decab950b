"""The automatic rollback's samples, kept across control-plane restarts (replica_stats.py).

Revision ID: 0022
Revises: 0021
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"


def upgrade() -> None:
    op.create_table(
        "replica_samples",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("replica_id", sa.Integer, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("error", sa.Boolean, nullable=False),
        sa.Column("ttft", sa.Float, nullable=True),
    )
    op.create_index("ix_replica_samples_replica_id", "replica_samples", ["replica_id"])


def downgrade() -> None:
    op.drop_index("ix_replica_samples_replica_id", "replica_samples")
    op.drop_table("replica_samples")
