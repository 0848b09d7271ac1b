"""Request limits: a pure ASGI middleware (`BodySizeLimit`) that answers 413 to a body over the
size limit (default 1 MiB, ``$AUTOTUNE_MAX_BODY_BYTES``) and 422 to JSON nested deeper than
`max_depth` (MAX_JSON_DEPTH), before the app parses anything.

Every request body of the API is a small JSON document, so anything near a MiB is a mistake or an
attack, and deep nesting breaks whatever walks the document recursively after the parse. The
answers are ``{"detail": ...}`` like every other error of the service.
"""

from __future__ import annotations

import json
import os
import re
from itertools import accumulate

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
MAX_BODY_ENV = "AUTOTUNE_MAX_BODY_BYTES"
MAX_JSON_DEPTH = 32
_TOO_LARGE = object()  # _read_body's answers other than the body
_GONE = object()
# A JSON string (escapes included), or an unterminated one up to the end of the body: every
# character after the opening quote is consumed by one alternative or the other, so the match
# never fails and backtracks (linear time, whatever the body).
_STRING = re.compile(rb'"(?:[^"\\]|\\.?)*(?:"|\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def max_body_bytes_from_env() -> int:
    """``$AUTOTUNE_MAX_BODY_BYTES`` (a positive integer), else DEFAULT_MAX_BODY_BYTES."""
    raw = os.environ.get(MAX_BODY_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BODY_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MAX_BODY_ENV}={raw!r} is not an integer; give the request body limit in bytes, "
                         f"e.g. {DEFAULT_MAX_BODY_BYTES}") from None
    if value <= 0:
        raise ValueError(f"{MAX_BODY_ENV}={raw!r}: the request body limit must be > 0 bytes")
    return value


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON document nest (0: a scalar; ``[[1]]``: 2),
    brackets inside strings not counted. Works on bytes without parsing, exactly for a valid
    document; a malformed one gets a depth too (the parser refuses it anyway, before it nests
    deeper than the brackets counted here)."""
    structure = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(0, max(accumulate(map(_STEP.__getitem__, structure)), default=0))


def _human(n: int) -> str:
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n} bytes"


def _content_length(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            return bytes(value).decode("latin-1").strip()
    return None


async def _reply(send: Send, status: int, detail: str | list[dict[str, object]]) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """ASGI middleware: HTTP request bodies above `max_bytes` get 413, JSON nested deeper than
    `max_depth` 422 (see the module docstring)."""

    def __init__(self, app: ASGIApp, max_bytes: int | None = None, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_bytes = max_body_bytes_from_env() if max_bytes is None else max_bytes
        self.max_depth = max_depth
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {self.max_bytes}")
        if self.max_depth <= 0:
            raise ValueError(f"max_depth must be > 0, got {self.max_depth}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            if not declared.isdigit():
                await _reply(send, 400, f"invalid Content-Length header {declared[:40]!r}; send the body's "
                                        "length in bytes")
                return
            if int(declared) > self.max_bytes:
                await _reply(send, 413, f"request body of {_human(int(declared))} is over the limit of "
                                        f"{_human(self.max_bytes)}; the API takes small JSON documents")
                return
        # Count what arrives too: a chunked body has no Content-Length (and a server need not
        # hold a client to the one it declared).
        body = await self._read_body(receive)
        if body is _TOO_LARGE:
            await _reply(send, 413, f"request body is over the limit of {_human(self.max_bytes)}; the API takes "
                                    "small JSON documents")
            return
        if body is _GONE:
            return  # the client disconnected before its body was complete: nobody to answer
        assert isinstance(body, bytes)
        # counting the opening brackets is cheap, and no body with fewer can nest deeper
        if body.count(b"[") + body.count(b"{") > self.max_depth and (depth := json_depth(body)) > self.max_depth:
            await _reply(send, 422, [{"loc": ["body"], "type": "json_too_deep",
                                      "msg": f"JSON nested {depth} levels deep is over the limit of {self.max_depth} "
                                             "levels; the API's documents nest a few levels (a study spec, a probe "
                                             "result): send flatter data"}])
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | object:
        """The whole body, read up to the limit; _TOO_LARGE once it passes it, _GONE on a disconnect."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _GONE
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return _TOO_LARGE
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive channel that yields `body` once, then defers to `receive` (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
