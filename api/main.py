"""The FastAPI app: `create_app()` builds it, `run_server()` serves it with uvicorn.

`autotune serve [--db URL] [--host H] [--port P]` calls `run_server`. The app's lifespan
runs the stale-lease reaper (every `reaper_interval_s`). Every error body is
``{"detail": ...}``: a string, or for 422 a list of ``{loc, msg, type}`` naming the field.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

import autotune
from api.errors import Invalid, ServiceError
from api.routes import health, studies, trials
from api.service import Reaper, TuningService
from api.settings import Settings

log = logging.getLogger(__name__)


# A model-level validator (StudySpec's space/baseline checks) reports at loc ["body"] with a
# message that starts with the dotted field, e.g. "Value error, space.params.foo: unknown knob".
_FIELD_IN_MESSAGE = re.compile(r"^Value error, ([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*): ")


def _validation_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors as {loc, msg, type}, without echoing the input back. An error whose
    message names a field inside its loc (a model validator's) gets that field as its loc."""
    out = []
    for error in exc.errors():
        loc = list(error.get("loc", ()))
        msg = str(error.get("msg", ""))
        match = _FIELD_IN_MESSAGE.match(msg)
        if match and loc[:1] == ["body"]:
            field = match.group(1).split(".")
            if field[:len(loc) - 1] == loc[1:]:  # the message's field lies within the reported loc
                loc = ["body", *field]
        out.append({"loc": loc, "msg": msg, "type": error.get("type", "")})
    return jsonable_encoder(out)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_request: Request, exc: ServiceError) -> JSONResponse:
        if isinstance(exc, Invalid):
            detail: Any = [{"loc": ["body", *exc.field.split(".")], "msg": exc.detail, "type": "value_error"}]
        else:
            detail = exc.detail
        return JSONResponse({"detail": detail}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _request_invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _validation_errors(exc)}, status_code=422)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected %s", type(exc).__name__, exc_info=exc)
        return JSONResponse({"detail": f"internal error ({type(exc).__name__}); the service log has the details"},
                            status_code=500)

    @app.exception_handler(OperationalError)
    async def _database_down(_request: Request, exc: OperationalError) -> JSONResponse:
        log.error("database error: %s", exc)
        return JSONResponse({"detail": "the database is unavailable; check AUTOTUNE_DB_URL and retry"},
                            status_code=503)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service on `settings.db_url` (default: Settings() from the environment).

    Creates the service tables and Optuna's on first use. The reaper thread runs while the
    app's lifespan does (uvicorn, or `with TestClient(app)`).
    """
    settings = settings or Settings()
    service = TuningService(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        reaper = Reaper(service, settings.reaper_interval_s)
        reaper.start()
        try:
            yield
        finally:
            reaper.stop()
            service.close()

    app = FastAPI(title="autotune", version=autotune.__version__, lifespan=lifespan,
                  description="Finds the fastest PyTorch training config that keeps model quality.")
    app.state.settings = settings
    app.state.service = service
    for router in (studies.router, trials.router, health.router):
        app.include_router(router, prefix="/v1")
    _install_error_handlers(app)
    return app


def run_server(db_url: str | None = None, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve the API with uvicorn until interrupted (`db_url` None: AUTOTUNE_DB_URL or the default)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings() if db_url is None else Settings(db_url=db_url)
    log.info("autotune %s serving on http://%s:%d (database %s)", autotune.__version__, host, port,
             settings.db_url.split("@")[-1])
    import uvicorn

    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")
