"""The service's settings: one `Settings` object, read from the environment (prefix AUTOTUNE_)."""

from __future__ import annotations

from pydantic import Field
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
