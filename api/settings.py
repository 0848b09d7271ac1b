"""The service's settings: one `Settings` object, read from the environment (prefix AUTOTUNE_)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Everything the service can be told. Environment: AUTOTUNE_DB_URL, AUTOTUNE_AUTH, AUTOTUNE_LEASE_GRACE_S, ...

    The same database URL holds the service's own tables (``autotune_*``) and Optuna's
    RDB storage, so the Optuna dashboard can be pointed at it directly.
    """

    model_config = SettingsConfigDict(env_prefix="AUTOTUNE_", extra="ignore")

    db_url: str = Field("sqlite:///./autotune.db", description="SQLAlchemy URL, e.g. "
                        "postgresql+psycopg://user@host:5432/db; SQLite files run in WAL mode")
    lease_grace_s: float = Field(60.0, gt=0, description="a lease whose last heartbeat is older than this is stale: "
                                 "its trial is failed as 'lost'")
    reaper_interval_s: float = Field(5.0, gt=0, description="seconds between two sweeps for stale leases")
    sqlite_busy_timeout_s: float = Field(30.0, gt=0, description="how long a SQLite writer waits for the file lock")
    auth: bool = Field(True, description="require bearer tokens (`autotune token create`) on every write: admin "
                       "for studies, worker or admin for trials; off only on a loopback address")
    token_cache_s: float = Field(2.0, ge=0, description="how long a token lookup is cached: a revoked token "
                                 "stops working within this time")


class SettingsError(ValueError):
    """An AUTOTUNE_* environment variable the service cannot read; the message names it and its value."""


def from_environment(**overrides: Any) -> Settings:
    """Settings from the environment (AUTOTUNE_*), `overrides` on top; SettingsError naming each
    variable whose value does not parse (pydantic's error would name only the field)."""
    try:
        return Settings(**overrides)
    except ValidationError as e:
        problems = []
        for error in e.errors():
            field = str(error["loc"][0]) if error["loc"] else "?"
            where = field if field in overrides else f"${Settings.model_config['env_prefix']}{field.upper()}"
            problems.append(f"{where}: {error['input']!r}: {error['msg']}")
        raise SettingsError("; ".join(problems) + " (unset it for the default)") from None
