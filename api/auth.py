"""Bearer tokens: how they are made and stored, and how a request's token is checked.

Only a token's SHA-256 is stored: the secret, printed once by `autotune token create`, cannot be
recovered from the database. Roles: ``admin`` may do everything, ``worker`` the trial calls; reads
and /v1/health need no token. `TokenStore` reads and writes the table; `TokenVerifier` checks a
request's token, caching each lookup for `cache_s` seconds (a revoked token stops working within
them, in every service process).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import ClassVar

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from autotune.api.db import TOKEN_ROLES, Database, TokenRow, utcnow
from autotune.api.errors import Conflict, Invalid, NotFound, ServiceError

log = logging.getLogger(__name__)

TOKEN_PREFIX = "at_"  # recognisable in logs and secret scanners
TOKEN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
HOW_TO_GET_A_TOKEN = ("create one with `autotune token create --role {role}` on the service's database and pass it "
                      "with --token or AUTOTUNE_TOKEN (HTTP: `Authorization: Bearer <token>`)")


class Unauthenticated(ServiceError):
    """401: no token, or one the service does not know (unknown or revoked)."""

    status_code = 401
    headers: ClassVar[dict[str, str]] = {"WWW-Authenticate": "Bearer"}


class Forbidden(ServiceError):
    """403: a valid token whose role may not do this."""

    status_code = 403


@dataclass(frozen=True)
class TokenInfo:
    """A token's row without its hash."""

    id: int
    name: str
    role: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the token's name and role (`ANONYMOUS` when auth is off)."""

    name: str
    role: str

    def may(self, role: str) -> bool:
        """Whether this caller may act as `role` (an admin may act as anyone)."""
        return self.role == role or self.role == "admin"


ANONYMOUS = Caller(name="anonymous (auth off)", role="admin")


def new_secret() -> str:
    """A fresh token: the prefix and 256 random bits."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """The stored form of `token`: its SHA-256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def how_to_get(role: str) -> str:
    return HOW_TO_GET_A_TOKEN.format(role=role)


def a_token(role: str) -> str:
    return f"an {role} token" if role[0] in "aeiou" else f"a {role} token"


def _info(row: TokenRow) -> TokenInfo:
    return TokenInfo(id=row.id, name=row.name, role=row.role, created_at=row.created_at,
                     last_used_at=row.last_used_at, revoked_at=row.revoked_at)


def check_role(role: str) -> None:
    if role not in TOKEN_ROLES:
        raise Invalid("role", f"role {role!r} is not allowed; allowed: {' | '.join(TOKEN_ROLES)}")


def check_name(name: str) -> None:
    if not TOKEN_NAME_PATTERN.match(name):
        raise Invalid("name", f"token name {name!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', "
                              "starting with a letter or digit")
    if name.isdigit():
        raise Invalid("name", f"token name {name!r} is all digits, which reads as a token id: add a letter")


class TokenStore:
    """The ``autotune_tokens`` table. Each method is one transaction."""

    def __init__(self, db: Database) -> None:
        self.db = db

    @classmethod
    def open(cls, url: str) -> TokenStore:
        """A store on `url`, migrated to the newest schema first (the CLI's way in: the first
        admin token is made before the service ever ran). Close it with `close()`."""
        db = Database(url)
        db.upgrade()
        return cls(db)

    def close(self) -> None:
        self.db.dispose()

    def create(self, role: str, name: str | None = None) -> tuple[str, TokenInfo]:
        """A new token of `role`: (the secret, shown only now; its row). `name` defaults to
        ``ROLE-xxxxxx``; Conflict if a token (even a revoked one) has that name."""
        check_role(role)
        name = name or f"{role}-{secrets.token_hex(3)}"
        check_name(name)
        secret = new_secret()
        row = TokenRow(name=name, role=role, token_sha256=hash_token(secret), created_at=utcnow())
        try:
            with self.db.transaction() as session:
                session.add(row)
                session.flush()
                info = _info(row)
        except IntegrityError as e:
            raise Conflict(f"a token named {name!r} exists already: choose another --name "
                           "(`autotune token list` shows them)") from e
        return secret, info

    def tokens(self) -> list[TokenInfo]:
        """Every token, revoked ones included, oldest first."""
        with self.db.read() as session:
            return [_info(row) for row in session.scalars(select(TokenRow).order_by(TokenRow.id))]

    def revoke(self, name_or_id: str) -> TokenInfo:
        """Revoke the token named `name_or_id` (or with that id, if it is all digits); revoking
        a revoked token changes nothing. NotFound when there is no such token."""
        column = TokenRow.id if name_or_id.isdigit() else TokenRow.name
        key: int | str = int(name_or_id) if name_or_id.isdigit() else name_or_id
        with self.db.transaction() as session:
            row = session.scalars(select(TokenRow).where(column == key)).one_or_none()
            if row is None:
                raise NotFound(f"no token {name_or_id!r}: `autotune token list` shows the names and ids")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
            return _info(row)

    def lookup(self, token: str) -> TokenInfo | None:
        """The row of `token` (revoked or not); None if the service never issued it."""
        with self.db.read() as session:
            row = session.scalars(select(TokenRow).where(TokenRow.token_sha256 == hash_token(token))).one_or_none()
            return None if row is None else _info(row)

    def touch(self, token_id: int, when: datetime) -> None:
        with self.db.transaction() as session:
            session.execute(update(TokenRow).where(TokenRow.id == token_id).values(last_used_at=when))

    def active_count(self) -> int:
        with self.db.read() as session:
            return session.scalar(select(func.count()).select_from(TokenRow).where(TokenRow.revoked_at.is_(None))) or 0


class TokenVerifier:
    """Turns a bearer token into a `Caller`, or raises Unauthenticated / Forbidden.

    Lookups are cached per token hash for `cache_s` seconds (unknown tokens too), so the
    hot path (heartbeats, reports) rarely reads the table; `last_used_at` is written at most
    once per `touch_every_s` per token.
    """

    def __init__(self, store: TokenStore, cache_s: float = 2.0, touch_every_s: float = 60.0) -> None:
        self.store = store
        self.cache_s = cache_s
        self.touch_every = timedelta(seconds=touch_every_s)
        # A time-to-live cache by hand: a dict of (monotonic stamp, lookup) with a size cap. The usual
        # library (cachetools) is not a dependency of the service, and a dozen lines need none.
        self._cache: dict[str, tuple[float, TokenInfo | None]] = {}
        self._lock = threading.Lock()

    def _lookup(self, token: str) -> TokenInfo | None:
        key = hash_token(token)
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        info = self.store.lookup(token)
        if info is not None and info.active:
            info = self._touch(info)
        with self._lock:
            if len(self._cache) > 10_000:  # someone is sending random tokens: start over
                self._cache.clear()
            self._cache[key] = (now, info)
        return info

    def _touch(self, info: TokenInfo) -> TokenInfo:
        now = utcnow()
        if info.last_used_at is not None and now - info.last_used_at < self.touch_every:
            return info
        try:
            self.store.touch(info.id, now)
        except SQLAlchemyError as e:  # bookkeeping only: never fail a request for it
            log.warning("could not record the use of token %r: %s", info.name, e)
            return info
        return replace(info, last_used_at=now)

    def authenticate(self, token: str | None, role: str) -> Caller:
        """The caller behind `token`, which must be allowed to act as `role`."""
        if not token:
            raise Unauthenticated(f"this request needs {a_token(role)} and none was sent: {how_to_get(role)}")
        info = self._lookup(token)
        if info is None:
            raise Unauthenticated(f"the token sent is not one this service issued (or its database): "
                                  f"{how_to_get(role)}")
        if not info.active:
            raise Unauthenticated(f"token {info.name!r} was revoked at {info.revoked_at:%Y-%m-%d %H:%M:%S} UTC: "
                                  f"{how_to_get(role)}")
        caller = Caller(name=info.name, role=info.role)
        if not caller.may(role):
            raise Forbidden(f"token {info.name!r} is {a_token(info.role)}, and this request needs {a_token(role)}: "
                            f"{how_to_get(role)}")
        return caller


def warn_if_no_tokens(store: TokenStore, db_hint: str) -> None:
    """Log a warning (with the fix) when auth is on but no token can pass it."""
    if store.active_count() == 0:
        log.warning("authentication is on and the database has no active token, so every write will be refused "
                    "(401): create tokens with `autotune token create --role admin --db %s` (and --role worker "
                    "for the workers)", db_hint)
