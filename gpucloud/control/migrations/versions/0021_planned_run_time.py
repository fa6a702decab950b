"""A train job's planned run time (the scheduler's estimate when it has no time limit).

Revision ID: 0021
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0018"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("planned_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("planned_seconds")
