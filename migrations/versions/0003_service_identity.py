"""The service's identity: one row holding a UUID made with the tables (GET /v1/health shows it).

A worker's spooled result names the service id it was leased from, and is delivered only to
a service showing that id: trial ids restart at 1 in every database, so a service restarted
on another database (same URL, maybe the same tokens) must not be handed another database's
results. Each database gets its own id here, also one upgraded from 0002.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-27
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "autotune_service",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("service_id", sa.String(length=36), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.bulk_insert(table, [{"id": 1, "service_id": str(uuid.uuid4()),
                            "created_at": datetime.now(timezone.utc).replace(tzinfo=None)}])


def downgrade() -> None:
    op.drop_table("autotune_service")
