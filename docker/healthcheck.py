#!/usr/bin/env python3
"""The service image's HEALTHCHECK: exit 0 when GET $AUTOTUNE_HEALTH_URL answers 200, else 1.

AUTOTUNE_HEALTH_URL defaults to http://127.0.0.1:8000/v1/health (the image's CMD serves on
port 8000; set the variable too when you change the port, or to check another program of the
image, as deploy/compose.yaml does for optuna-dashboard). /v1/health needs no token and
answers 503 when the database is unreachable, so "healthy" means the API and its database
both work. One line on stdout either way (Docker keeps it in `docker inspect`). Standard
library only: the slim base image has no curl.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/v1/health"
TIMEOUT_S = 4.0  # below the HEALTHCHECK --timeout, so this script reports instead of being killed


def _one_line(body: bytes, limit: int = 200) -> str:
    return " ".join(body.decode(errors="replace").split())[:limit]


def check(url: str, timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """(healthy, one line saying why)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200, f"{response.status} {_one_line(response.read(1000))}"
    except urllib.error.HTTPError as e:  # 503: the database is unreachable
        return False, f"{e.code} {_one_line(e.read(1000))}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"no answer from {url}: {getattr(e, 'reason', e)}"


def main() -> int:
    healthy, line = check(os.environ.get("AUTOTUNE_HEALTH_URL") or DEFAULT_URL)
    print(line)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
