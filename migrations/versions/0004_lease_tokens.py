"""Lease tokens: each lease row gets a random token (UUID4 hex) made when the lease is created.

The service hands the token out with the lease (`TrialLease.lease_token`, the same one when a
worker gets its own active lease back) and takes a complete (heartbeat, report) that carries a
token only for the lease holding that token. Trial ids restart at 1 in every database, and a
backup holds the same service id as the database it was copied from: a service restarted on
such a copy may hold a trial of the same id, study and number leased to the same worker, yet
another lease; its token tells them apart, so a result measured for one is never stored in the
other. Leases made before this revision keep NULL ("from before tokens": the old checks only).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # a nullable column: SQLite adds it in place (batch mode copies nothing for an add_column)
    with op.batch_alter_table("autotune_leases") as batch:
        batch.add_column(sa.Column("token", sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_leases") as batch:
        batch.drop_column("token")
