"""FastAPI dependencies: typed aliases routes declare to get the service, the settings and the caller.

Auth (api/auth.py): a route that takes `WorkerAuth` needs a worker or admin token, one that
takes `AdminAuth` an admin token; 401 (with ``WWW-Authenticate: Bearer``) without a valid
token, 403 with a token of the wrong role. With `Settings.auth` off both let everyone in.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from autotune.api.auth import ANONYMOUS, Caller, TokenVerifier
from autotune.api.service import TuningService
from autotune.api.settings import Settings

bearer = HTTPBearer(auto_error=False, description="a token from `autotune token create --role worker|admin`")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def get_service(request: Request) -> TuningService:
    """The app's TuningService (made by create_app, one per app)."""
    service: TuningService = request.app.state.service
    return service


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None, role: str) -> Caller:
    settings: Settings = request.app.state.settings
    if not settings.auth:
        return ANONYMOUS
    verifier: TokenVerifier = request.app.state.tokens
    return verifier.authenticate(credentials.credentials if credentials else None, role)


def require_worker(request: Request, credentials: Credentials) -> Caller:
    """The caller, who holds a worker (or admin) token."""
    return _authenticate(request, credentials, "worker")


def require_admin(request: Request, credentials: Credentials) -> Caller:
    """The caller, who holds an admin token."""
    return _authenticate(request, credentials, "admin")


ServiceDep = Annotated[TuningService, Depends(get_service)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
WorkerAuth = Annotated[Caller, Depends(require_worker)]
AdminAuth = Annotated[Caller, Depends(require_admin)]
