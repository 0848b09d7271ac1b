"""The service tables: studies, leases, reports, workers.

This is the schema `Base.metadata.create_all` made before migrations existed: a database
holding these tables without a version row is stamped at this revision (api/db.py).

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE = sa.text("state = 'active'")


def upgrade() -> None:
    op.create_table(
        "autotune_studies",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("space", sa.JSON(), nullable=False),
        sa.Column("hardware", sa.String(length=200), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("stopped_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_index("ix_autotune_studies_hardware", "autotune_studies", ["hardware"])

    op.create_table(
        "autotune_workers",
        sa.Column("worker_id", sa.String(length=200), nullable=False),
        sa.Column("hardware", sa.String(length=200), nullable=False),
        sa.Column("last_seen", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("worker_id"),
    )

    op.create_table(
        "autotune_leases",
        sa.Column("trial_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("study_name", sa.String(length=64), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(length=200), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("leased_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["study_name"], ["autotune_studies.name"]),
        sa.PrimaryKeyConstraint("trial_id"),
    )
    op.create_index("ix_autotune_leases_state_heartbeat", "autotune_leases", ["state", "heartbeat_at"])
    op.create_index("ix_autotune_leases_study_name", "autotune_leases", ["study_name"])
    # at most one active lease per worker
    op.create_index("uq_autotune_leases_active_worker", "autotune_leases", ["worker_id"], unique=True,
                    sqlite_where=ACTIVE, postgresql_where=ACTIVE)

    op.create_table(
        "autotune_reports",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("study_name", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("prune", sa.Boolean(), nullable=False),
        sa.Column("prune_reason", sa.String(length=2000), nullable=True),
        sa.ForeignKeyConstraint(["trial_id"], ["autotune_leases.trial_id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_autotune_reports_study_name", "autotune_reports", ["study_name"])
    op.create_index("ix_autotune_reports_trial_id", "autotune_reports", ["trial_id"])


def downgrade() -> None:
    op.drop_table("autotune_reports")  # dropping a table drops its indexes
    op.drop_table("autotune_leases")
    op.drop_table("autotune_workers")
    op.drop_table("autotune_studies")
