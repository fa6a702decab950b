"""CPU and memory: what a node has, what a job or a deployment's replica requests.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"

_TABLES = ("nodes", "jobs", "deployments")


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("cpu_milli", sa.Integer, nullable=False, server_default="0"))
            batch.add_column(
                sa.Column("memory_mib", sa.Integer, nullable=False, server_default="0")
            )


def downgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("memory_mib")
            batch.drop_column("cpu_milli")
