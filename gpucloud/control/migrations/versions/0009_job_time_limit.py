"""A job may say how long each of its runs may last (its time limit, in seconds).

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("time_limit", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", recreate="never") as batch:
        batch.drop_column("time_limit")
