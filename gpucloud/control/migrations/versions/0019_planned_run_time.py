"""A train job's planned run time (the scheduler's estimate when it has no time limit),
and the share of a GPU a deployment's replica asks for.

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("planned_seconds", sa.Float(), nullable=True))
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(
            sa.Column("gpu_milli", sa.Integer(), nullable=False, server_default="1000")
        )


def downgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("gpu_milli")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("planned_seconds")
