"""GET /v1/health: is the service up and its database reachable, and which service is it (open: needs no token)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field
from sqlalchemy.exc import SQLAlchemyError

import autotune
from autotune.api import crud
from autotune.api.deps import ServiceDep
from autotune.api.errors import DatabaseUnavailable

router = APIRouter(tags=["health"])


class HealthReply(BaseModel):
    status: str = "ok"
    db: str = Field(..., description="the database's dialect (sqlite, postgresql)")
    version: str = Field(..., description="the service's autotune version")
    service_id: str | None = Field(None, description="this service's identity: a UUID made with its database's "
                                                     "tables. A restart on the same database keeps it; another "
                                                     "database has another. A worker delivers a spooled result only "
                                                     "to the service id it leased the trial from (None: tables "
                                                     "without the identity row)")


@router.get("/health", response_model=HealthReply)
def health(service: ServiceDep) -> HealthReply:
    """Status, database dialect, version and service id; 503 when the database is unreachable."""
    try:
        with service.db.read() as session:  # reading the identity is the database's ping
            service_id = crud.service_id(session)
    except SQLAlchemyError as e:
        raise DatabaseUnavailable(f"database unreachable ({type(e).__name__}); check AUTOTUNE_DB_URL") from e
    return HealthReply(db=service.db.dialect, version=autotune.__version__, service_id=service_id)
