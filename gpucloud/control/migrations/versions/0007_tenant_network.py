"""A tenant's jobs may run in their own network namespace (loopback only).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("network", sa.String(16), nullable=False, server_default="host"))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("network")
