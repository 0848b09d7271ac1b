"""The FastAPI app: `create_app()` builds it, `run_server()` serves it with uvicorn (`autotune serve`).

The app's lifespan runs the stale-lease reaper. Every error body is ``{"detail": ...}``: a string,
or for 422 a list of ``{loc, msg, type}``. Writes need a bearer token (api/auth.py); reads,
/v1/health and the offline docs pages are open, and `run_server` refuses to listen on a
non-loopback address with auth off.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

import autotune
from autotune.api.auth import TokenStore, TokenVerifier, warn_if_no_tokens
from autotune.api.db import StudyRow
from autotune.api.docs_assets import install_docs
from autotune.api.errors import Invalid, ServiceError
from autotune.api.limits import BodySizeLimit
from autotune.api.reaper import Reaper
from autotune.api.routes import health, studies, trials
from autotune.api.service import TuningService
from autotune.api.settings import Settings, from_environment

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
        return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None))

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

    Migrates the service tables to the newest revision (api/db.py: idempotent, safe with
    several processes) and creates Optuna's on first use. The reaper thread runs while the
    app's lifespan does (uvicorn, or `with TestClient(app)`).
    """
    settings = settings or from_environment()
    service = TuningService(settings)
    tokens = TokenVerifier(TokenStore(service.db), cache_s=settings.token_cache_s)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if settings.auth:
            warn_if_no_tokens(tokens.store, _safe_url(settings.db_url))
        else:
            log.warning("authentication is off (--no-auth / AUTOTUNE_AUTH=false): anyone who reaches this "
                        "service can create and stop studies and report trials")
        reaper = Reaper(service, settings.reaper_interval_s)
        reaper.start()
        try:
            yield
        finally:
            reaper.stop()
            service.close()

    app = FastAPI(title="autotune", version=autotune.__version__, lifespan=lifespan,
                  description="Finds the fastest PyTorch training config that keeps model quality.",
                  docs_url=None, redoc_url=None)  # FastAPI's pages load from a CDN: install_docs serves them
    app.state.settings = settings
    app.state.service = service
    app.state.tokens = tokens
    for router in (studies.router, trials.router, health.router):
        app.include_router(router, prefix="/v1")
    install_docs(app)  # /docs and /redoc with their assets from the service (api/docs_assets.py), no token
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimit)  # 413 for request bodies over AUTOTUNE_MAX_BODY_BYTES (1 MiB)
    return app


class ServeRefused(ValueError):
    """`run_server` will not start as asked (the message says what to change)."""


def _safe_url(url: str) -> str:
    """`url` without its password, for logs and messages."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can parse: show the part after any credentials
        return url.split("@")[-1]


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine (localhost, 127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_listen(host: str, settings: Settings) -> None:
    """Refuse to listen beyond this machine without authentication."""
    if not settings.auth and not is_loopback(host):
        raise ServeRefused(f"refusing to serve on {host} without authentication: anyone on the network could "
                           "create studies and report trials. Drop --no-auth (and AUTOTUNE_AUTH=false) and "
                           "create tokens with `autotune token create --role admin|worker`, or listen on "
                           "127.0.0.1 only")


def check_port(host: str, port: int) -> None:
    """Refuse a port another process listens on, before the database is touched (uvicorn would
    find out only after the service had created and migrated it)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeRefused(f"cannot listen on {host}: {e.strerror}; pass --host with an address of this "
                           "machine (127.0.0.1, 0.0.0.0)") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no clash
        try:
            probe.bind(address)
        except OSError as e:
            raise ServeRefused(f"cannot listen on {host}:{port}: {e.strerror} (another `autotune serve`, or another "
                               f"server, holds it: `ss -ltnp 'sport = :{port}'` names it); pass another --port, "
                               "or stop that process") from None


def run_server(db_url: str | None = None, host: str = "127.0.0.1", port: int = 8000,
               auth: bool | None = None) -> None:
    """Serve the API with uvicorn until interrupted (`db_url` None: AUTOTUNE_DB_URL or the default;
    `auth` None: AUTOTUNE_AUTH or on). Raises ServeRefused before starting anything when auth
    is off and `host` is not a loopback address, or when the port is taken."""
    overrides: dict[str, Any] = {}
    if db_url is not None:
        overrides["db_url"] = db_url
    if auth is not None:
        overrides["auth"] = auth
    settings = from_environment(**overrides)
    check_listen(host, settings)
    check_port(host, port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().getEffectiveLevel() > logging.INFO:  # the CLI configured WARNING: the service says more
        logging.getLogger("autotune.api").setLevel(logging.INFO)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # autotune.api.db logs what the migrations changed
    # the first line: which database, and what it holds (before create_app migrates or creates it)
    log.info("autotune %s starting on http://%s:%d (%s, auth %s)", autotune.__version__, host, port,
             database_line(settings.db_url), "on" if settings.auth else "OFF")
    app = create_app(settings)
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="info")


def _sqlite_file(url: str) -> Path | None:
    """The absolute path of a SQLite database file (None: another database, or in memory)."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:
        return None
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database).expanduser().resolve()


def database_line(url: str) -> str:
    """Which database the service is about to open (a SQLite file by its absolute path), and
    what it holds: the first thing an operator needs to see when a restart lands on the wrong
    one (a new, empty SQLite file in another directory). Reads only; creates nothing."""
    from sqlalchemy import create_engine, text

    sqlite_file = _sqlite_file(url)
    where = f"database {sqlite_file}" if sqlite_file is not None else f"database {_safe_url(url)}"
    if sqlite_file is not None and not sqlite_file.exists():
        return f"{where}: a new file, created empty"
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            n = int(connection.execute(text(f"SELECT count(*) FROM {StudyRow.__tablename__}")).scalar() or 0)
    except Exception:  # no autotune tables yet (or unreachable: create_app says so next)
        return f"{where}: no autotune tables yet (empty)"
    finally:
        engine.dispose()
    return f"{where}: {n} stud{'y' if n == 1 else 'ies'}" + ("" if n else " (empty)")
