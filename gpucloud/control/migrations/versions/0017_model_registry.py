"""The model registry: versions of a tenant's named models (where the weights are, their
content hash, what produced them), their evaluation results, and which registered version
a deployment version serves (with the eval its promotion requires) or a train job starts
from.

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"


def upgrade() -> None:
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False, index=True),
        sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id"), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("number", sa.Integer, nullable=False),
        sa.Column("uri", sa.Text, nullable=False),
        sa.Column("content_hash", sa.String(80), nullable=False),
        sa.Column("hash_kind", sa.String(16), nullable=False),
        sa.Column("files", sa.JSON, nullable=False),
        sa.Column("base_id", sa.Integer, sa.ForeignKey("model_versions.id"), nullable=True),
        sa.Column("base_model", sa.Text, nullable=True),
        sa.Column("dataset", sa.Text, nullable=True),
        sa.Column("dataset_hash", sa.String(80), nullable=True),
        sa.Column("train_config", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("run", sa.Text, nullable=True),
        sa.Column("step", sa.Integer, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.UniqueConstraint("tenant_id", "name", "number"),
        sa.UniqueConstraint("tenant_id", "name", "content_hash"),
    )
    op.create_table(
        "model_evals",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "version_id", sa.Integer, sa.ForeignKey("model_versions.id"), nullable=False, index=True
        ),
        sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id"), nullable=False),
        sa.Column("task", sa.String(255), nullable=False),
        sa.Column("task_hash", sa.String(80), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("metric", sa.String(32), nullable=False),
        sa.Column("score", sa.Float, nullable=False),
        sa.Column("ci_low", sa.Float, nullable=False),
        sa.Column("ci_high", sa.Float, nullable=False),
        sa.Column("n", sa.Integer, nullable=False),
        sa.Column("result", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.UniqueConstraint("version_id", "task_hash"),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("model_ref", sa.String(80), nullable=True))
        batch.add_column(sa.Column("model_dir", sa.Text, nullable=True))
    # No foreign key: on SQLite adding one copies the table, which replicas reference.
    with op.batch_alter_table("deployment_versions") as batch:
        batch.add_column(sa.Column("model_version_id", sa.Integer, nullable=True))
        batch.add_column(sa.Column("model_ref", sa.String(80), nullable=True))
        batch.add_column(sa.Column("require_eval", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("deployment_versions") as batch:
        batch.drop_column("require_eval")
        batch.drop_column("model_ref")
        batch.drop_column("model_version_id")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("model_dir")
        batch.drop_column("model_ref")
    op.drop_table("model_evals")
    op.drop_table("model_versions")
