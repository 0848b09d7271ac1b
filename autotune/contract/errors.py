"""The probe's failure type, shared by the knob functions, the optimizers and the step graph."""

from __future__ import annotations

FAILURE_KINDS = ("oom", "nan", "timeout", "unsupported", "error")


class ProbeError(Exception):
    """A probe ended in a known failure kind: oom | nan | timeout | unsupported | error."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
