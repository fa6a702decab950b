"""Fractional GPUs: a job may ask for a share of one GPU (gpu_milli < 1000, gpus 1), and a
usage record holds the GPUs it counts, a share included.

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("gpu_milli", sa.Integer, nullable=False, server_default="1000"))
    with op.batch_alter_table("usage") as batch:
        batch.alter_column("gpus", type_=sa.Float, existing_type=sa.Integer)


def downgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.alter_column("gpus", type_=sa.Integer, existing_type=sa.Float)
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("gpu_milli")
