"""The one place the command line reaches the service (autotune.api, the repository's api/):
`service()`, on first use only, so commands that never touch the service start without it."""

from __future__ import annotations

from types import ModuleType


def service(app: bool = False) -> ModuleType:
    """The service's package (autotune.api, the repository's api/) with the modules its commands use: the database, its
    tokens and backups, settings and errors (`db`, `token`); with `app`, also the web
    application (`serve`: fastapi, Optuna). The one place the CLI reaches the service, on
    first use only: the core never imports it at module level, so `autotune worker` and
    `autotune probe` start without fastapi or sqlalchemy, and `autotune token create` without
    the web application (about 1 CPU-second less)."""
    import autotune.api.auth
    import autotune.api.backup
    import autotune.api.db
    import autotune.api.errors
    import autotune.api.settings

    if app:
        import autotune.api.main
    return autotune.api
