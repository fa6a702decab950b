"""Rate limits of tenants and keys, priority classes of keys, and how many batch requests
a deployment's replicas take at once.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("rate_limit", sa.JSON(none_as_null=True), nullable=True))
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(
            sa.Column("priority_class", sa.String(16), nullable=False, server_default="interactive")
        )
        batch.add_column(sa.Column("rate_limit", sa.JSON(none_as_null=True), nullable=True))
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(
            sa.Column("batch_in_flight", sa.Integer(), nullable=False, server_default="2")
        )


def downgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("batch_in_flight")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("rate_limit")
        batch.drop_column("priority_class")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("rate_limit")
