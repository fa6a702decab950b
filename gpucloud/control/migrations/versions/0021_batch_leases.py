"""Batch leases: which control plane runs a batch, until when (batch_runner.py).

Revision ID: 0021
Revises: 0020
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("lease_owner", sa.String(255), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("lease_expires_at")
        batch.drop_column("lease_owner")
