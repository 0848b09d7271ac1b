"""autotune.worker.client: retries, error mapping and the wire models, against a mock transport."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from autotune.contract.results import LeaseRequest
from autotune.worker.client import (
    ApiError,
    Client,
    Conflict,
    Invalid,
    NotFound,
    ServiceUnavailable,
    format_detail,
)

LEASE = {"trial_id": 3, "study": "s", "number": 1, "params": {"batch_size": 4}, "config": {"batch_size": 4},
         "workload": "ups", "preset": "tiny", "probe": {"samples": 40, "timeout_s": 60.0}, "is_baseline": False}


def client_for(handler: Any, **kw: Any) -> Client:
    kw.setdefault("max_backoff_s", 0.01)
    return Client("http://svc", "secret", transport=httpx.MockTransport(handler), **kw)


def test_retries_5xx_and_connection_errors_then_succeeds() -> None:
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("connection refused", request=request)
        if len(calls) == 2:
            return httpx.Response(503, json={"detail": "database unavailable"})
        return httpx.Response(200, json=LEASE)

    lease = client_for(handler, retry_for_s=None).lease(LeaseRequest(worker_id="w", hardware="cpu"))
    assert lease is not None and lease.trial_id == 3 and lease.probe.samples == 40
    assert len(calls) == 3
    assert calls[-1].headers["Authorization"] == "Bearer secret"
    assert calls[-1].url.path == "/v1/trials/lease"


def test_204_means_no_trial() -> None:
    lease = client_for(lambda r: httpx.Response(204)).lease(LeaseRequest(worker_id="w", hardware="cpu"))
    assert lease is None


def test_gives_up_after_the_retry_budget() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(ServiceUnavailable, match="cannot reach the autotune service at http://svc"):
        client_for(handler, retry_for_s=0.05).health()


def test_a_cancel_event_ends_a_forever_retry() -> None:
    cancel = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        cancel.set()
        return httpx.Response(502)

    with pytest.raises(ServiceUnavailable, match="interrupted"):
        client_for(handler, retry_for_s=None, cancel=cancel).health()


@pytest.mark.parametrize(("status", "error"), [(404, NotFound), (409, Conflict), (422, Invalid), (400, ApiError)])
def test_4xx_raise_at_once_with_the_detail(status: int, error: type[ApiError]) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(status, json={"detail": "no study named 'x'"})

    with pytest.raises(error) as info:
        client_for(handler).get_study("x")
    assert info.value.status_code == status and info.value.message == "no study named 'x'"
    assert len(calls) == 1


def test_a_422_list_names_the_field() -> None:
    detail = [{"loc": ["body", "n_trials"], "msg": "Input should be greater than or equal to 1", "type": "x"},
              {"loc": ["body", "space", "params", "foo"], "msg": "Value error, space.params.foo: unknown knob",
               "type": "value_error"}]
    assert format_detail(detail) == ("n_trials: Input should be greater than or equal to 1; "
                                     "space.params.foo: unknown knob")


def test_a_plain_http_client_loads_no_ca_bundle_and_an_https_one_verifies(monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx's default TLS context (the CA bundle: 25-50 ms of a command's start) is built for an
    https:// service only; an http:// one gets a bare context that trusts no certificate."""
    import ssl

    built: list[Any] = []
    default = ssl.create_default_context

    def counting(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        context = default(*args, **kwargs)
        built.append(context)
        return context

    monkeypatch.setattr(ssl, "create_default_context", counting)
    with Client("http://127.0.0.1:8765", "t"):
        assert built == []
    with Client("https://autotune.example:8765", "t"):
        assert len(built) == 1
        assert built[0].verify_mode == ssl.CERT_REQUIRED and built[0].check_hostname
        assert built[0].cert_store_stats()["x509_ca"] > 0  # the CA bundle is loaded: certificates are checked
