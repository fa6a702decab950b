"""Deployment versions: each replica serves one version of its deployment (a model dir and
engine settings); a new version may take a share of the traffic as a canary.

Every existing deployment gets its version 1, stable, from its own model dir and engine
settings, and its replicas serve it.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"


def upgrade() -> None:
    op.create_table(
        "deployment_versions",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "deployment_id", sa.Integer, sa.ForeignKey("deployments.id"), nullable=False, index=True
        ),
        sa.Column("number", sa.Integer, nullable=False),
        sa.Column("model_dir", sa.Text, nullable=False),
        sa.Column("engine_args", sa.JSON, nullable=False),
        sa.Column("command", sa.Text),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("percent", sa.Float, nullable=False),
        sa.Column("guard", sa.JSON(none_as_null=True)),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("ended_at", sa.Float),
        sa.Column("reason", sa.Text),
        sa.UniqueConstraint("deployment_id", "number"),
    )
    op.execute(
        "INSERT INTO deployment_versions (deployment_id, number, model_dir, engine_args, "
        "command, state, percent, created_at) "
        "SELECT id, 1, model_dir, engine_args, command, 'stable', 100, created_at FROM deployments"
    )
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("version_id", sa.Integer, nullable=True))
    op.execute(
        "UPDATE replicas SET version_id = (SELECT v.id FROM deployment_versions v "
        "WHERE v.deployment_id = replicas.deployment_id)"
    )
    with op.batch_alter_table("replicas") as batch:
        batch.alter_column("version_id", existing_type=sa.Integer, nullable=False)
        batch.create_foreign_key(
            "fk_replicas_version_id", "deployment_versions", ["version_id"], ["id"]
        )


def downgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.drop_constraint("fk_replicas_version_id", type_="foreignkey")
        batch.drop_column("version_id")
    op.drop_table("deployment_versions")
