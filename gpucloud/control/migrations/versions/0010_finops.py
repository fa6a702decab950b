"""FinOps: GPU prices per pool, versioned by their effective date; monthly budgets per
tenant (optionally per user or job label); the node each usage interval ran on (its pool's
price); labels on jobs (showback and budgets group by them).

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"


def upgrade() -> None:
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("gpu_type", sa.String(32), nullable=False),
        sa.Column("pool", sa.String(127), nullable=False, server_default=""),
        sa.Column("per_hour", sa.Float, nullable=False),
        sa.Column("effective_from", sa.Float, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.UniqueConstraint("gpu_type", "pool", "effective_from"),
    )
    op.create_table(
        "budgets",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False, index=True),
        sa.Column("user", sa.String(63), nullable=False, server_default=""),
        sa.Column("label", sa.String(127), nullable=False, server_default=""),
        sa.Column("unit", sa.String(16), nullable=False),
        sa.Column("amount", sa.Float, nullable=False),
        sa.Column("soft", sa.Float, nullable=False),
        sa.Column("on_exhausted", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.UniqueConstraint("tenant_id", "user", "label"),
    )
    with op.batch_alter_table("usage") as batch:
        batch.add_column(sa.Column("node", sa.String(63), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("labels", sa.JSON, nullable=False, server_default="{}"))


def downgrade() -> None:
    with op.batch_alter_table("jobs", recreate="never") as batch:
        batch.drop_column("labels")
    with op.batch_alter_table("usage", recreate="never") as batch:
        batch.drop_column("node")
    op.drop_table("budgets")
    op.drop_table("prices")
