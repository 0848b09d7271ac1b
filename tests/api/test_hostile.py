"""Hostile input: whatever a client sends, the service answers 4xx with a message, never 5xx.

* property-based: schemathesis generates requests from the app's own OpenAPI schema (valid
  and invalid ones) for every operation; no answer may be a 5xx (or an exception), and the
  answers must match the schema's documented responses and content types;
* explicit: malformed JSON, bodies over the size limit (413, with and without
  Content-Length, through a real server too), wrong types, unicode and emoji names, path
  traversal in study names, spaces given as paths, and the strict validation of a study
  spec (422 naming the field: unknown knobs, bad ranges, impossible combinations).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import lease, make_settings, serve

from autotune.api.limits import DEFAULT_MAX_BODY_BYTES, MAX_BODY_ENV
from autotune.api.main import create_app
from autotune.contract.protocol import StudySpec
from autotune.contract.results import LeaseRequest

JSON = {"content-type": "application/json"}
TRIAL_POSTS = [("/v1/trials/1/heartbeat", {"worker_id": "w"}),
               ("/v1/trials/1/report", {"worker_id": "w", "step": 1, "metrics": {"loss": 0.5}}),
               ("/v1/trials/1/complete", {"worker_id": "w", "result": {}})]
WRITES = ["/v1/studies", "/v1/trials/lease", *(path for path, _ in TRIAL_POSTS)]


def _detail(response: httpx.Response) -> Any:
    """The error's detail; asserts the answer is a 4xx with a non-empty message."""
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    detail = response.json()["detail"]
    assert detail, response.text
    if isinstance(detail, list):
        assert all(error["msg"] and error["loc"] for error in detail), detail
    return detail


def _loc_error(response: httpx.Response, loc: list[Any]) -> str:
    """The message of the 422 error at `loc` (or inside it); fails naming what was answered."""
    assert response.status_code == 422, f"{response.status_code}: {response.text[:500]}"
    detail = _detail(response)
    for error in detail:
        if error["loc"][:len(loc)] == loc:
            return str(error["msg"])
    raise AssertionError(f"no error at {loc}: {detail}")


# --- property-based: the whole API from its OpenAPI schema ---------------------------------------

FUZZ_EXAMPLES = int(os.environ.get("AUTOTUNE_FUZZ_EXAMPLES", "50"))  # per operation and generation mode


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_driven_fuzzing_never_gets_a_5xx(db_url: str, mode: str) -> None:
    """Every operation, fed valid (positive) and invalid (negative) requests generated from the
    OpenAPI schema, answers without a 5xx, as the schema documents it, on each database backend.
    A study and a leased trial exist, so generated names and small trial ids reach real rows.
    (One test per generation mode, so that the two can run side by side.)"""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import content_type_conformance, not_a_server_error, response_schema_conformance

    app = create_app(make_settings(db_url))  # schemathesis runs its lifespan (until the process exits)
    service = app.state.service
    service.create_study(StudySpec(name="s", baseline_seeds=1, n_trials=50, remeasure={"top_k": 0}))
    service.lease_trial(LeaseRequest(worker_id="w", hardware="cpu"))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: dict[tuple[str, str], str] = {}

    def fuzz(operation: Any, mode: GenerationMode) -> None:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            try:
                response = case.call()  # the in-process app re-raises what it answered 500 for
                case.validate_response(response, checks=[not_a_server_error, response_schema_conformance,
                                                         content_type_conformance])
            except Exception as e:
                failures.setdefault((operation.label, type(e).__name__),
                                    f"{operation.label} [{mode.value}]: {type(e).__name__}: {str(e)[:600]}\n"
                                    f"  reproduce: {case.as_curl_command()[:600]}")

        try:
            check()
        except Exception as e:  # e.g. a parameterless GET has no invalid requests to generate
            if type(e).__name__ != "Unsatisfiable":
                raise

    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12, [op.label for op in operations]
    for operation in operations:
        fuzz(operation, GenerationMode(mode))
    assert not failures, "\n".join(failures.values())


# --- malformed bodies and size limits ------------------------------------------------------------


@pytest.mark.parametrize("path", WRITES)
@pytest.mark.parametrize("body", [b"{not json", b'{"name": }', b"", b"null", b"[]", b'"x"', b"\xff\xfe\x00",
                                  b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"],
                         ids=["broken", "no-value", "empty", "null", "list", "string", "binary", "deep"])
def test_malformed_json_is_a_4xx_with_a_message(client: TestClient, path: str, body: bytes) -> None:
    _detail(client.post(path, content=body, headers=JSON))


def test_a_body_over_the_limit_is_413_with_or_without_content_length(client: TestClient) -> None:
    big = b'{"name": "big", "hardware": "' + b"a" * (2 * 2**20) + b'"}'
    for path in WRITES:
        r = client.post(path, content=big, headers=JSON)
        assert r.status_code == 413 and "over the limit of 1 MiB" in r.json()["detail"], r.text
    chunks = (big[i:i + 65536] for i in range(0, len(big), 65536))
    r = client.post("/v1/studies", content=chunks, headers=JSON)  # chunked: no Content-Length
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    assert r.status_code == 413 and "over the limit" in r.json()["detail"]
    r = client.post("/v1/studies", content=b'{"name": "big"}', headers={**JSON, "content-length": "lots"})
    assert r.status_code == 400 and "Content-Length" in r.json()["detail"]
    # bodies within the limit, chunked or not, reach the app unchanged
    assert client.post("/v1/studies", content=iter([b'{"name": ', b'"chunked"}']), headers=JSON).status_code == 201
    assert client.post("/v1/studies", json={"name": "plain", "hardware": "a" * 200}).status_code == 201
    assert client.get("/v1/studies").json()["count"] == 2


def test_the_body_limit_is_configurable(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_BODY_ENV, "2048")
    with TestClient(create_app(make_settings(sqlite_url))) as small:
        assert small.post("/v1/studies", json={"name": "s", "hardware": "a" * 100}).status_code == 201
        r = small.post("/v1/studies", json={"name": "t", "hardware": "a" * 3000})
        assert r.status_code == 413 and "over the limit of 2048 bytes" in r.json()["detail"]
    monkeypatch.setenv(MAX_BODY_ENV, "-1")
    with pytest.raises(ValueError, match=MAX_BODY_ENV), TestClient(create_app(make_settings(sqlite_url))):
        pass  # the service does not start: the middleware is built on startup
    assert DEFAULT_MAX_BODY_BYTES == 2**20


def test_a_real_server_answers_413_before_reading_a_huge_body(app: FastAPI) -> None:
    with serve(app) as url:
        r = httpx.post(f"{url}/v1/studies", content=b"x" * (16 * 2**20), headers=JSON, timeout=30)
        assert r.status_code == 413 and "16 MiB is over the limit" in r.json()["detail"]
        assert httpx.get(f"{url}/v1/health", timeout=10).status_code == 200


# --- wrong types ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "loc"), [
    ("/v1/studies", {"name": 5}, ["body", "name"]),
    ("/v1/studies", {"name": "x", "n_trials": "many"}, ["body", "n_trials"]),
    ("/v1/studies", {"name": "x", "n_trials": 10**30}, ["body", "n_trials"]),
    ("/v1/studies", {"name": "x", "seed": 1.5}, ["body", "seed"]),
    ("/v1/studies", {"name": "x", "seed": 2**64}, ["body", "seed"]),
    ("/v1/studies", {"name": "x", "baseline": [1, 2]}, ["body", "baseline"]),
    ("/v1/studies", {"name": "x", "space": 5}, ["body", "space"]),
    ("/v1/studies", {"name": "x", "probe": "fast"}, ["body", "probe"]),
    ("/v1/studies", {"name": "x", "probe": {"samples": -1}}, ["body", "probe", "samples"]),
    ("/v1/studies", {"name": "x", "objectives": "throughput"}, ["body", "objectives"]),
    ("/v1/studies", {"name": "x", "max_memory_gb": "1GB"}, ["body", "max_memory_gb"]),
    ("/v1/studies", {"name": "x", "gate": {"k": None}}, ["body", "gate", "k"]),
    ("/v1/studies", {"name": "x", "surprise": 1}, ["body", "surprise"]),
    ("/v1/trials/lease", {"worker_id": 5, "hardware": "cpu"}, ["body", "worker_id"]),
    ("/v1/trials/lease", {"worker_id": "w", "hardware": ["cpu"]}, ["body", "hardware"]),
    ("/v1/trials/lease", {"worker_id": "w"}, ["body", "hardware"]),
    ("/v1/trials/1/heartbeat", {"worker_id": None}, ["body", "worker_id"]),
    ("/v1/trials/1/report", {"worker_id": "w", "step": -1, "metrics": {}}, ["body", "step"]),
    ("/v1/trials/1/report", {"worker_id": "w", "step": 1, "metrics": {"loss": "low"}}, ["body", "metrics", "loss"]),
    ("/v1/trials/1/report", {"worker_id": "w", "step": 1, "metrics": [0.5]}, ["body", "metrics"]),
    ("/v1/trials/1/complete", {"worker_id": "w", "result": [1]}, ["body", "result"]),
    ("/v1/trials/x/complete", {"worker_id": "w", "result": {}}, ["path", "trial_id"]),
])
def test_wrong_types_are_422_naming_the_field(client: TestClient, path: str, body: dict[str, Any],
                                              loc: list[Any]) -> None:
    assert _loc_error(client.post(path, json=body), loc)


def test_a_bad_query_value_is_422_naming_it(client: TestClient) -> None:
    assert "json" in _loc_error(client.get("/v1/studies/s/best", params={"format": "xml"}), ["query", "format"])


def test_huge_trial_ids_are_4xx(backend_client: TestClient) -> None:
    for trial_id in (2**31, 2**63 - 1, 2**63, 10**30, -(10**30)):
        for path, body in TRIAL_POSTS:
            _detail(backend_client.post(path.replace("/1/", f"/{trial_id}/"), json=body))


def test_wrong_methods_and_routes_are_4xx_with_a_message(client: TestClient) -> None:
    assert client.put("/v1/studies", json={}).status_code == 405
    _detail(client.put("/v1/studies", json={}))
    _detail(client.get("/v1/nowhere"))
    _detail(client.post("/v1/studies", content=b'{"name": "x"}', headers={"content-type": "text/plain"}))


# --- unicode, emoji and control characters --------------------------------------------------------


@pytest.mark.parametrize("name", ["études", "🚀", "名前", "a\u202eb", "x\u0000", "x\ny", " x", "x y", "ｘ"])
def test_non_ascii_study_names_are_422(client: TestClient, name: str) -> None:
    assert _loc_error(client.post("/v1/studies", json={"name": name}), ["body", "name"])
    assert client.get("/v1/studies").json()["count"] == 0


@pytest.mark.parametrize("path", ["/v1/studies/🚀", "/v1/studies/%F0%9F%9A%80/trials", "/v1/studies/%00",
                                  "/v1/studies/x%0Ay/pareto", "/v1/studies/%E2%80%AEx/best"])
def test_non_ascii_names_in_paths_are_4xx(client: TestClient, path: str) -> None:
    _detail(client.get(path))
    _detail(client.delete(path))


def test_unicode_free_text_is_kept_intact(client: TestClient) -> None:
    hardware = "GPU ☃ 🚀 名前"
    space = {"name": "ünïcödé", "description": "🚀 fast ✓", "params": {"batch_size": {"choices": [2, 4]}}}
    r = client.post("/v1/studies", json={"name": "u", "hardware": hardware, "space": space, "baseline_seeds": 1})
    assert r.status_code == 201, r.text
    info = client.get("/v1/studies/u").json()
    assert info["spec"]["hardware"] == hardware and info["spec"]["space"]["description"] == "🚀 fast ✓"
    held = lease(client, "worker 🚀", hardware=hardware)
    assert held is not None and held["study"] == "u"
    assert client.post(f"/v1/trials/{held['trial_id']}/heartbeat", json={"worker_id": "worker 🚀"}).status_code == 200


@pytest.mark.parametrize(("path", "body", "loc"), [
    ("/v1/studies", {"name": "c", "hardware": "cpu\u0000"}, ["body", "hardware"]),
    ("/v1/studies", {"name": "c", "hardware": "cpu\nGPU"}, ["body", "hardware"]),
    ("/v1/trials/lease", {"worker_id": "w\u0000", "hardware": "cpu"}, ["body", "worker_id"]),
    ("/v1/trials/lease", {"worker_id": "w", "hardware": "\t"}, ["body", "hardware"]),
    ("/v1/trials/1/heartbeat", {"worker_id": "w\r\n"}, ["body", "worker_id"]),
])
def test_control_characters_in_ids_are_422(backend_client: TestClient, path: str, body: dict[str, Any],
                                           loc: list[Any]) -> None:
    """NUL cannot be stored in PostgreSQL text, and a newline in an id forges log lines."""
    assert "control characters" in _loc_error(backend_client.post(path, json=body), loc)


# --- path traversal -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/studies/..%2F..%2Fetc", "/v1/studies/..%2F..%2Fetc/trials",
                                  "/v1/studies/%2e%2e", "/v1/studies/../x", "/v1/studies/..%5C..%5Cx",
                                  "/v1/studies/.hidden/best", "/v1/studies/%2Fetc%2Fpasswd/pareto"])
def test_path_traversal_in_study_names_is_4xx(client: TestClient, path: str) -> None:
    _detail(client.get(path))
    _detail(client.delete(path))


@pytest.mark.parametrize("name", ["../x", "..", "a/b", "a\\b", "/etc/passwd", "..%2Fx", ".x"])
def test_path_traversal_in_names_given_in_bodies_is_422(client: TestClient, name: str) -> None:
    assert _loc_error(client.post("/v1/studies", json={"name": name}), ["body", "name"])
    assert _loc_error(client.post("/v1/trials/lease", json={"worker_id": "w", "hardware": "cpu", "study": name}),
                      ["body", "study"])


@pytest.fixture
def cwd_with_a_space_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The service's working directory holds `evil.yaml`, a valid space: it must stay unread."""
    (tmp_path / "evil.yaml").write_text("params:\n  batch_size: {choices: [2]}\n")
    monkeypatch.chdir(tmp_path)
    yield tmp_path


@pytest.mark.parametrize("space", ["/etc/passwd", "../x.yaml", "evil.yaml", "./evil.yaml", "cpu.yaml",
                                   "../../search_spaces/cpu", "~/.ssh/id_rsa", "C:\\Windows\\win.ini",
                                   "file:///etc/passwd", "cpu\u0000", "..", ""])
def test_a_space_given_as_a_path_is_422(client: TestClient, cwd_with_a_space_file: Path, space: str) -> None:
    msg = _loc_error(client.post("/v1/studies", json={"name": "p", "space": space}), ["body", "space"])
    assert "not a space name" in msg and "no paths" in msg


def test_a_space_name_is_looked_up_in_search_spaces_only(client: TestClient, cwd_with_a_space_file: Path) -> None:
    msg = _loc_error(client.post("/v1/studies", json={"name": "p", "space": "evil"}), ["body", "space"])
    assert "no search space 'evil'; known: cpu, h100" in msg


# --- strict validation of a study spec --------------------------------------------------------------

GPU = "NVIDIA H100 80GB HBM3"
GUARDED_PREFETCH = {"num_workers": {"choices": [0, 2]},
                    "prefetch_factor": {"choices": [2], "when": {"num_workers": [2]}}}


@pytest.mark.parametrize(("spec", "loc", "words"), [
    ({"baseline": {"batchsize": 8}}, ["baseline", "batchsize"], "did you mean 'batch_size'"),
    ({"space": {"params": {"batchsize": {"choices": [8]}}}}, ["space", "params", "batchsize"], "unknown knob"),
    ({"space": {"params": {"batch_size": {"choices": [8]}}, "fixed": {"zzz": 1}}}, ["space", "fixed", "zzz"],
     "unknown knob"),
    ({"baseline": {"batch_size": 0}}, ["baseline", "batch_size"], "too small"),
    ({"baseline": {"lr": -1}}, ["baseline", "lr"], "too small"),
    ({"space": {"params": {"batch_size": {"low": 0, "high": 8}}}}, ["space", "params", "batch_size", "low"],
     "too small"),
    ({"space": {"params": {"batch_size": {"low": 8, "high": 2}}}}, ["space", "params", "batch_size"], "low <= high"),
    ({"space": {"params": {"batch_size": {"low": 2, "high": 8, "step": 0}}}},
     ["space", "params", "batch_size", "step"], "positive"),
    ({"baseline": {"bucket_cap_mb": 0}}, ["baseline", "bucket_cap_mb"], "too small"),
    ({"baseline": {"bucket_cap_mb": -5}}, ["baseline", "bucket_cap_mb"], "too small"),
    ({"space": {"params": {"batch_size": {"choices": [8]}}, "fixed": {"bucket_cap_mb": 0}}},
     ["space", "fixed", "bucket_cap_mb"], "too small"),
    ({"baseline": {"prefetch_factor": 2}}, ["baseline", "prefetch_factor"], "num_workers > 0"),
    ({"baseline": {"prefetch_factor": 2, "num_workers": 0}}, ["baseline", "prefetch_factor"], "num_workers > 0"),
    ({"space": {"params": {"batch_size": {"choices": [8]}}, "fixed": {"prefetch_factor": 2}}},
     ["space", "fixed", "prefetch_factor"], "num_workers > 0"),
    ({"space": {"params": {"num_workers": {"choices": [0, 2]}, "prefetch_factor": {"choices": [2, 4]}}}},
     ["space", "params", "prefetch_factor"], "when: {num_workers: [2]}"),
    ({"space": {"params": {"num_workers": {"low": 0, "high": 4}, "prefetch_factor": {"low": 1, "high": 4}}}},
     ["space", "params", "prefetch_factor"], "num_workers=0"),
    ({"space": {"params": {"num_workers": {"choices": [0, 2]}}, "fixed": {"persistent_workers": True}}},
     ["space", "fixed", "persistent_workers"], "num_workers > 0"),
    ({"baseline": {"precision": "fp8"}}, ["baseline", "precision"], "CUDA GPU"),
    ({"space": {"params": {"precision": {"choices": ["bf16", "fp8"]}}}}, ["space", "params", "precision"],
     "CUDA GPU"),
    ({"space": {"params": {"batch_size": {"choices": [8]}}, "fixed": {"precision": "fp8"}}},
     ["space", "fixed", "precision"], "CUDA GPU"),
    ({"space": "h100"}, ["space", "params", "precision"], "fp8"),  # a GPU space on a cpu study
    ({"baseline": {"precision": "fp64"}}, ["baseline", "precision"], "allowed: fp32 | tf32 | bf16 | fp16 | fp8"),
    ({"space": {"params": {"precision": {"choices": ["fp16", "int4"]}}}}, ["space", "params", "precision", "choices"],
     "allowed: fp32"),
    ({"baseline": {"lr": float("nan")}}, ["baseline", "lr"], "finite"),
    ({"space": {"params": {"bucket_cap_mb": {"choices": [25, 50]}}}, "hardware": GPU},
     ["space", "params", "bucket_cap_mb"], "world size > 1"),
    ({"workload": "nope"}, ["workload"], "unknown workload 'nope'; installed: ups"),
    ({"workload": "os.system"}, ["workload"], "unknown workload"),
    ({"preset": "huge"}, ["preset"], "unknown preset 'huge' for workload 'ups'; known: tiny, full"),
    ({"seed": -1}, ["seed"], "greater than or equal to 0"),
])
def test_a_bad_spec_is_422_naming_the_field(client: TestClient, spec: dict[str, Any], loc: list[str],
                                            words: str) -> None:
    # json.dumps, not httpx's encoder: NaN has no JSON spelling, but the server's parser takes Python's
    response = client.post("/v1/studies", content=json.dumps({"name": "bad", **spec}), headers=JSON)
    assert response.status_code == 422, response.text
    detail = _detail(response)
    assert [error["loc"] for error in detail] == [["body", *loc]], detail
    assert words in detail[0]["msg"]
    assert client.get("/v1/studies").json()["count"] == 0


@pytest.mark.parametrize("spec", [
    {"baseline": {"precision": "fp8", "num_workers": 2, "prefetch_factor": 4}, "hardware": GPU, "space": "h100"},
    {"space": {"params": GUARDED_PREFETCH}},
    {"space": {"params": {"num_workers": {"choices": [1, 2]}, "prefetch_factor": {"choices": [2, 4]}}}},
    {"baseline": {"num_workers": 2, "prefetch_factor": 2, "persistent_workers": True, "bucket_cap_mb": 0.5}},
    {"workload": "ups", "preset": "full"},
])
def test_specs_that_keep_the_rules_are_accepted(client: TestClient, spec: dict[str, Any]) -> None:
    r = client.post("/v1/studies", json={"name": "good", **spec})
    assert r.status_code == 201, r.text
