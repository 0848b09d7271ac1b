"""A small typed HTTP client of the autotune service (the routes of docs/service.md).

Every call retries what a restart or a network hiccup looks like (connection errors,
timeouts, HTTP 5xx) with exponential backoff capped at `max_backoff_s`, for up to
`retry_for_s` seconds (None: until it succeeds or `cancel` is set). Any other error reply
raises an `ApiError` subclass carrying the status and the service's ``detail``:

    404 NotFound · 409 Conflict (e.g. the trial is no longer leased to this worker)
    422 Invalid (the detail names the field) · 401/403 Unauthorized (no valid token, or one of
    the wrong role: the detail says which token to create; `token` is sent as a bearer token)

Retrying POSTs is safe by the protocol: lease is idempotent per worker (a worker that asks
again gets back the trial it holds), complete is idempotent for the same worker, and a
repeated report only adds a duplicate data point.

Thread safety: one `Client` may be shared by threads (httpx.Client is thread-safe); the
retry state is per call.

For a running service from Python (what `autotune submit/status/best/stop` do)::

    from autotune import Client
    with Client("http://127.0.0.1:8000", token=ADMIN_TOKEN) as service:
        service.submit("study.yaml")           # a StudySpec, its dict, or a YAML/JSON file
        info = service.status("my-study")      # StudyInfo: state, counts, the verdict so far
        verdict = service.best("my-study")     # Recommendation (NotFound until there is one)
        service.stop("my-study")               # no more leases; the data is kept
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from autotune.contract.protocol import StudySpec
from autotune.contract.results import (
    CompleteRequest,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseRequest,
    ReportReply,
    ReportRequest,
    TrialLease,
)
from autotune.contract.views import Recommendation, StudyInfo, StudyList, TrialInfo, TrialList

log = logging.getLogger(__name__)

DEFAULT_API = "http://127.0.0.1:8000"
ModelT = TypeVar("ModelT", bound=BaseModel)
# Replies hold specs the service validated when they were stored: a workload or space that is
# not installed on this machine must not make them unreadable here (see StudySpec's checks).
STORED = {"stored": True}


class ClientError(Exception):
    """Base class of everything this client raises."""


class ServiceUnavailable(ClientError):
    """The service could not be reached (or kept answering 5xx) within the retry budget."""

    def __init__(self, base_url: str, cause: str) -> None:
        super().__init__(f"cannot reach the autotune service at {base_url}: {cause}")
        self.base_url = base_url
        self.cause = cause


class ApiError(ClientError):
    """The service answered with an error status. `detail` is its ``{"detail": ...}``."""

    def __init__(self, status_code: int, detail: Any, method: str, path: str) -> None:
        self.status_code = status_code
        self.detail = detail
        self.method = method
        self.path = path
        super().__init__(f"{method} {path} → HTTP {status_code}: {format_detail(detail)}")

    @property
    def message(self) -> str:
        return format_detail(self.detail)


class NotFound(ApiError):
    pass


class NotAutotune(ApiError):
    """What answered at the URL is not an autotune service (HTML, or JSON of another shape)."""

    def __init__(self, base_url: str, response: httpx.Response, method: str, path: str, why: str) -> None:
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        super().__init__(response.status_code, f"{base_url} is not an autotune service: {method} {path} answered "
                                                f"HTTP {response.status_code} with {why} ({kind}). Check --api (or "
                                                "AUTOTUNE_API): the URL `autotune serve` prints at start, e.g. "
                                                "http://127.0.0.1:8000", method, path)


class Conflict(ApiError):
    pass


class Invalid(ApiError):
    pass


class Unauthorized(ApiError):
    pass


_ERRORS: dict[int, type[ApiError]] = {404: NotFound, 409: Conflict, 422: Invalid, 401: Unauthorized,
                                      403: Unauthorized}


def format_detail(detail: Any) -> str:
    """The service's error detail as one readable line; a 422 list becomes "field: message; ..."."""
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict) and "msg" in item:
                loc = [str(p) for p in item.get("loc") or () if p != "body"]
                msg = str(item["msg"]).removeprefix("Value error, ")
                field = ".".join(loc)
                parts.append(msg if not field or msg.startswith(field + ":") else f"{field}: {msg}")
            else:
                parts.append(str(item))
        return "; ".join(parts)
    if isinstance(detail, str):
        return detail
    return json.dumps(detail)


class Client:
    """The REST API of one autotune service.

    `retry_for_s`: how long one call keeps retrying transient failures (None: forever,
    until `cancel` is set). `cancel`: an event that ends a forever-retrying call early
    with ServiceUnavailable (the worker sets it on SIGINT/SIGTERM).
    """

    def __init__(self, base_url: str = DEFAULT_API, token: str | None = None, *, retry_for_s: float | None = 30.0,
                 max_backoff_s: float = 10.0, timeout_s: float = 30.0, cancel: threading.Event | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry_for_s = retry_for_s
        self.max_backoff_s = max_backoff_s
        self.cancel = cancel
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # httpx builds its TLS context (the CA bundle loaded: 25-50 ms of every command's start)
        # even for a plain-HTTP service, which never uses it; there it gets a bare one instead,
        # which verifies as strictly and trusts no certificate at all
        verify: ssl.SSLContext | bool = True if self.base_url.startswith("https://") else \
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self._http = httpx.Client(base_url=self.base_url, headers=headers, verify=verify,
                                  timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)), transport=transport)
        self._outage_logged = False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport -------------------------------------------------------------------------------

    def request(self, method: str, path: str, *, json_body: Any = None, params: dict[str, str] | None = None,
                retry_for_s: float | bool | None = True, interruptible: bool | None = None,
                cancel: threading.Event | None = None,
                on_retry: Callable[[str, float], None] | None = None) -> httpx.Response:
        """Send one request, retrying transient failures; returns a 2xx response or raises.

        `retry_for_s`: True → the client's budget; None → forever; a number → that many
        seconds. `interruptible`: whether setting `cancel` ends the retries early (default:
        only for a forever retry; a bounded one is usually a last report that must not be cut
        short, but a worker's lease loop retries in bounded slices and wants both). `cancel`:
        this call's own cancel event instead of the client's (a thread that must be able to
        abandon its call without stopping everyone else's)."""
        budget = self.retry_for_s if retry_for_s is True else retry_for_s
        honour_cancel = budget is None if interruptible is None else interruptible
        cancel = self.cancel if cancel is None else cancel
        assert budget is None or isinstance(budget, (int, float))
        started = time.monotonic()
        delay = 0.25
        # by hand, not tenacity or urllib3's Retry (no dependency; httpx retries only failed connects): the
        # budget is per call, a cancel event cuts the wait short, and a 4xx is an answer, raised at once
        while True:
            try:
                response = self._http.request(method, path, json=json_body, params=params)
            except httpx.TransportError as e:
                cause = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                if response.status_code < 500:
                    if response.status_code >= 400:
                        raise self._error(response, method, path)
                    if self._outage_logged:
                        log.warning("the autotune service at %s answers again", self.base_url)
                        self._outage_logged = False
                    return response
                cause = f"HTTP {response.status_code}: {_detail(response)}"
            elapsed = time.monotonic() - started
            if budget is not None and elapsed + delay > budget:
                raise ServiceUnavailable(self.base_url, cause)
            if honour_cancel and cancel is not None and cancel.is_set():
                raise ServiceUnavailable(self.base_url, f"{cause} (gave up: interrupted)")
            if on_retry is not None:
                on_retry(cause, delay)
            elif not self._outage_logged:
                log.warning("autotune service at %s: %s; retrying (backoff up to %.0f s)", self.base_url, cause,
                            self.max_backoff_s)
                self._outage_logged = True
            if cancel is not None and honour_cancel:
                if cancel.wait(delay):
                    raise ServiceUnavailable(self.base_url, f"{cause} (gave up: interrupted)")
            else:
                time.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    def _error(self, response: httpx.Response, method: str, path: str) -> ApiError:
        try:
            body = response.json()
        except ValueError:  # every error of the service is JSON ({"detail": ...}): something else answered
            return NotAutotune(self.base_url, response, method, path, "a body that is not JSON")
        if not (isinstance(body, dict) and "detail" in body):
            return NotAutotune(self.base_url, response, method, path, "JSON without the service's error detail")
        cls = _ERRORS.get(response.status_code, ApiError)
        return cls(response.status_code, body["detail"], method, path)

    def _model(self, response: httpx.Response, model: type[ModelT], method: str, path: str) -> ModelT:
        """`response`'s body as `model`; NotAutotune when it is not JSON of that shape."""
        try:
            body = response.json()
        except ValueError:
            raise NotAutotune(self.base_url, response, method, path, "a body that is not JSON") from None
        try:
            return model.model_validate(body, context=STORED)
        except ValidationError as e:
            raise NotAutotune(self.base_url, response, method, path,
                              f"JSON that is not a {model.__name__} ({e.error_count()} field error(s))") from None

    def _get(self, path: str, model: type[ModelT], **kw: Any) -> ModelT:
        return self._model(self.request("GET", path, **kw), model, "GET", path)

    def _post(self, path: str, body: BaseModel, model: type[ModelT], **kw: Any) -> ModelT:
        response = self.request("POST", path, json_body=body.model_dump(mode="json"), **kw)
        return self._model(response, model, "POST", path)

    # --- the routes ------------------------------------------------------------------------------

    def health(self, **kw: Any) -> dict[str, Any]:
        response = self.request("GET", "/v1/health", **kw)
        try:
            data = response.json()
        except ValueError:
            raise NotAutotune(self.base_url, response, "GET", "/v1/health", "a body that is not JSON") from None
        if not (isinstance(data, dict) and "version" in data and "db" in data):
            raise NotAutotune(self.base_url, response, "GET", "/v1/health", "JSON that is not the service's health")
        return data

    def submit(self, spec: StudySpec | dict[str, Any] | str, **kw: Any) -> StudyInfo:
        """Create a study: a StudySpec, its dict, or the path of a YAML/JSON spec file
        (Invalid names a bad field before anything is sent)."""
        if isinstance(spec, str):
            from pathlib import Path

            import yaml

            spec = yaml.safe_load(Path(spec).read_text())
        if not isinstance(spec, StudySpec):
            try:
                spec = StudySpec.model_validate(spec)
            except ValidationError as e:
                raise Invalid(422, [dict(error) for error in e.errors()], "POST", "/v1/studies") from None
        return self.create_study(spec, **kw)

    def status(self, name: str, **kw: Any) -> StudyInfo:
        """The study: its state, its trials by state, the verdict so far (`best`)."""
        return self.get_study(name, **kw)

    def stop(self, name: str, **kw: Any) -> StudyInfo:
        """Stop leasing the study's trials (`autotune stop`); everything measured is kept."""
        return self.stop_study(name, **kw)

    def create_study(self, spec: StudySpec, **kw: Any) -> StudyInfo:
        return self._post("/v1/studies", spec, StudyInfo, **kw)

    def list_studies(self, **kw: Any) -> StudyList:
        return self._get("/v1/studies", StudyList, **kw)

    def get_study(self, name: str, **kw: Any) -> StudyInfo:
        return self._get(f"/v1/studies/{name}", StudyInfo, **kw)

    def stop_study(self, name: str, **kw: Any) -> StudyInfo:
        return self._model(self.request("DELETE", f"/v1/studies/{name}", **kw), StudyInfo, "DELETE",
                           f"/v1/studies/{name}")

    def trials(self, name: str, **kw: Any) -> TrialList:
        return self._get(f"/v1/studies/{name}/trials", TrialList, **kw)

    def pareto(self, name: str, **kw: Any) -> TrialList:
        return self._get(f"/v1/studies/{name}/pareto", TrialList, **kw)

    def best(self, name: str, **kw: Any) -> Recommendation:
        return self._get(f"/v1/studies/{name}/best", Recommendation, params={"format": "json"}, **kw)

    def best_yaml(self, name: str, **kw: Any) -> str:
        return self.request("GET", f"/v1/studies/{name}/best", params={"format": "yaml"}, **kw).text

    def lease(self, request: LeaseRequest, **kw: Any) -> TrialLease | None:
        """The next trial for this worker, or None (HTTP 204: nothing to do now)."""
        response = self.request("POST", "/v1/trials/lease", json_body=request.model_dump(mode="json"), **kw)
        if response.status_code == 204 or not response.content:
            return None
        return self._model(response, TrialLease, "POST", "/v1/trials/lease")

    # `lease_token`: the lease's (TrialLease.lease_token); the service then takes the call only for that lease

    def heartbeat(self, trial_id: int, worker_id: str, *, lease_token: str | None = None,
                  **kw: Any) -> HeartbeatReply:
        return self._post(f"/v1/trials/{trial_id}/heartbeat",
                          HeartbeatRequest(worker_id=worker_id, lease_token=lease_token), HeartbeatReply, **kw)

    def report(self, trial_id: int, worker_id: str, step: int, metrics: dict[str, float], *,
               lease_token: str | None = None, **kw: Any) -> ReportReply:
        return self._post(f"/v1/trials/{trial_id}/report",
                          ReportRequest(worker_id=worker_id, step=step, metrics=metrics, lease_token=lease_token),
                          ReportReply, **kw)

    def complete(self, trial_id: int, worker_id: str, result: dict[str, Any], *, lease_token: str | None = None,
                 **kw: Any) -> TrialInfo:
        return self._post(f"/v1/trials/{trial_id}/complete",
                          CompleteRequest(worker_id=worker_id, result=result, lease_token=lease_token), TrialInfo,
                          **kw)


def _detail(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        if "html" in response.headers.get("content-type", ""):  # a proxy's or another server's page
            return f"an HTML page ({response.reason_phrase}), not the service's JSON"
        return response.text.strip()[:500] or response.reason_phrase
    return body.get("detail", body) if isinstance(body, dict) else body
