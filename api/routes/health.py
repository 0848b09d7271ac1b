"""GET /v1/health: is the service up and its database reachable (open: needs no token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from sqlalchemy.exc import SQLAlchemyError

import autotune
from api.deps import ServiceDep
from api.errors import DatabaseUnavailable

router = APIRouter(tags=["health"])


@router.get("/health")
def health(service: ServiceDep) -> dict[str, Any]:
    """{"status": "ok", "db": <dialect>, "version": <autotune version>}; 503 when the database is unreachable."""
    try:
        service.db.ping()
    except SQLAlchemyError as e:
        raise DatabaseUnavailable(f"database unreachable ({type(e).__name__}); check AUTOTUNE_DB_URL") from e
    return {"status": "ok", "db": service.db.dialect, "version": autotune.__version__}
