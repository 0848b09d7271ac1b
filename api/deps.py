"""FastAPI dependencies: typed aliases routes declare to get the service and the settings."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.service import TuningService
from api.settings import Settings


def get_service(request: Request) -> TuningService:
    """The app's TuningService (made by create_app, one per app)."""
    service: TuningService = request.app.state.service
    return service


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


ServiceDep = Annotated[TuningService, Depends(get_service)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
