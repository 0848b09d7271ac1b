"""The service's exceptions. Each maps to one HTTP status; the message is the response's detail.

Foreign errors (SpaceError, Optuna's, SQLAlchemy's) are translated into these at the
boundary of the service (api/service.py, api/studies.py), so routes only ever see a ServiceError.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base class: `status_code` is the HTTP status, `detail` the readable body."""

    status_code = 500

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class NotFound(ServiceError):
    """The named study or trial does not exist."""

    status_code = 404


class Conflict(ServiceError):
    """The request clashes with the current state (duplicate name, trial not leased to the caller)."""

    status_code = 409


class Invalid(ServiceError):
    """A request that is well-formed but cannot be served; `field` is a dotted path to the culprit."""

    status_code = 422

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(detail)
        self.field = field


class DatabaseUnavailable(ServiceError):
    """The database cannot be reached (or is failing); retrying later may work."""

    status_code = 503
