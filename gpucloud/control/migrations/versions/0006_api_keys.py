"""API keys with a life cycle: a name, when each was last used, and when a rotated one
expires. Keys were already stored as SHA-256 hashes; existing ones keep working and are
named after their user.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("name", sa.String(63)))
        batch.add_column(sa.Column("last_used_at", sa.Float))
        batch.add_column(sa.Column("expires_at", sa.Float))
    op.execute(
        "UPDATE api_keys SET name = "
        "(SELECT users.name FROM users WHERE users.id = api_keys.user_id)"
    )
    with op.batch_alter_table("api_keys") as batch:
        batch.alter_column("name", existing_type=sa.String(63), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("expires_at")
        batch.drop_column("last_used_at")
        batch.drop_column("name")
