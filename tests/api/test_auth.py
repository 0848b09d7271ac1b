"""Bearer-token auth (api/auth.py, api/deps.py) with auth on, as `autotune serve` runs it.

Writes need a token (studies: admin; trials: worker or admin): 401 with
``WWW-Authenticate: Bearer`` without a valid one (missing, unknown, revoked), 403 with the
wrong role, and every refusal says how to get the right token. Reads stay open. Tokens are
stored as SHA-256 only. The CLI's `token create` makes tokens the service accepts over real
HTTP; the client and the worker surface refusals; serve refuses a non-loopback address
without auth.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from service_helpers import make_settings, probe_result, serve
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool

from autotune.api.auth import TOKEN_PREFIX, TokenStore
from autotune.api.main import check_listen, create_app, is_loopback
from autotune.api.settings import SettingsError, from_environment
from autotune.contract.protocol import StudySpec
from autotune.worker.client import Client, Unauthorized

SPEC = {"name": "s", "n_trials": 4, "baseline_seeds": 1, "remeasure": {"top_k": 0}}
LEASE = {"worker_id": "w1", "hardware": "cpu"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def store(sqlite_url: str) -> Iterator[TokenStore]:
    s = TokenStore.open(sqlite_url)
    yield s
    s.close()


@pytest.fixture
def tokens(store: TokenStore) -> dict[str, str]:
    """role -> a fresh token of that role."""
    return {role: store.create(role, f"test-{role}")[0] for role in ("admin", "worker")}


@pytest.fixture
def client(sqlite_url: str, tokens: dict[str, str]) -> Iterator[TestClient]:
    """A TestClient on an app with auth on and no token cache (every request looks its token up)."""
    with TestClient(create_app(make_settings(sqlite_url, auth=True, token_cache_s=0.0))) as c:
        yield c


def assert_refused(response: httpx.Response, status: int, *phrases: str) -> None:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    for phrase in ("autotune token create --role", "--token or AUTOTUNE_TOKEN", *phrases):
        assert phrase in detail, detail
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"


def trial_routes(trial_id: int) -> list[tuple[str, dict[str, Any]]]:
    return [("/v1/trials/lease", LEASE),
            (f"/v1/trials/{trial_id}/heartbeat", {"worker_id": "w1"}),
            (f"/v1/trials/{trial_id}/report", {"worker_id": "w1", "step": 1, "metrics": {"loss": 1.0}}),
            (f"/v1/trials/{trial_id}/complete", {"worker_id": "w1", "result": probe_result()})]


def test_every_write_without_a_token_is_401_saying_how_to_get_one(client: TestClient, tokens: dict[str, str]) -> None:
    assert_refused(client.post("/v1/studies", json=SPEC), 401, "needs an admin token and none was sent",
                   "--role admin")
    assert client.post("/v1/studies", json=SPEC, headers=bearer(tokens["admin"])).status_code == 201
    assert_refused(client.delete("/v1/studies/s"), 401, "--role admin")
    for path, body in trial_routes(1):
        assert_refused(client.post(path, json=body), 401, "needs a worker token", "--role worker")
    # nothing was done by the refused calls
    assert client.get("/v1/studies/s").json()["state"] == "running"
    assert client.get("/v1/studies/s/trials").json()["count"] == 0


def test_an_unknown_a_malformed_or_a_non_bearer_token_is_401(client: TestClient, tokens: dict[str, str]) -> None:
    for headers in (bearer(TOKEN_PREFIX + "x" * 43), bearer(tokens["admin"][:-1]), bearer(""),
                    {"Authorization": f"Basic {tokens['admin']}"}, {"Authorization": tokens["admin"]}):
        response = client.post("/v1/studies", json=SPEC, headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer"


def test_a_worker_token_may_not_create_or_stop_studies(client: TestClient, tokens: dict[str, str]) -> None:
    assert_refused(client.post("/v1/studies", json=SPEC, headers=bearer(tokens["worker"])), 403,
                   "token 'test-worker' is a worker token", "needs an admin token", "--role admin")
    client.post("/v1/studies", json=SPEC, headers=bearer(tokens["admin"]))
    assert_refused(client.delete("/v1/studies/s", headers=bearer(tokens["worker"])), 403, "--role admin")
    assert client.get("/v1/studies/s").json()["state"] == "running"


def test_each_role_does_what_it_may_and_reads_need_no_token(client: TestClient, tokens: dict[str, str]) -> None:
    admin, worker = bearer(tokens["admin"]), bearer(tokens["worker"])
    assert client.post("/v1/studies", json=SPEC, headers=admin).status_code == 201
    lease = client.post("/v1/trials/lease", json=LEASE, headers=worker).json()
    trial_id = lease["trial_id"]
    for path, body in trial_routes(trial_id)[1:]:
        if path.endswith("/complete"):
            body = {**body, "result": probe_result(lease["config"])}
        response = client.post(path, json=body, headers=worker)
        assert response.status_code == 200, (path, response.text)
    # an admin may act as a worker
    assert client.post("/v1/trials/lease", json={"worker_id": "w2", "hardware": "cpu"}, headers=admin).status_code \
        == 200
    for path in ("/v1/health", "/v1/studies", "/v1/studies/s", "/v1/studies/s/trials", "/v1/studies/s/pareto"):
        assert client.get(path).status_code == 200, path
    assert client.delete("/v1/studies/s", headers=admin).json()["state"] == "stopped"


def test_a_revoked_token_stops_working_within_the_cache_time(sqlite_url: str, store: TokenStore,
                                                             tokens: dict[str, str]) -> None:
    cache_s = 0.5
    with TestClient(create_app(make_settings(sqlite_url, auth=True, token_cache_s=cache_s))) as client:
        assert client.post("/v1/studies", json=SPEC, headers=bearer(tokens["admin"])).status_code == 201
        revoked_at = time.monotonic()
        store.revoke("test-admin")
        while True:
            sent = time.monotonic()  # a request's own slowness is not the token cache's
            response = client.delete("/v1/studies/s", headers=bearer(tokens["admin"]))
            if response.status_code == 401:
                break
            assert sent - revoked_at < cache_s + 1.0, "the revoked token still works"
            time.sleep(0.05)
        assert "token 'test-admin' was revoked at" in response.json()["detail"]
        assert response.headers["www-authenticate"] == "Bearer"
    assert [t.revoked_at is not None for t in store.tokens()] == [True, False]


def test_tokens_are_stored_as_sha256_only(sqlite_url: str, store: TokenStore, client: TestClient,
                                          tokens: dict[str, str]) -> None:
    client.post("/v1/studies", json=SPEC, headers=bearer(tokens["admin"]))  # records last_used_at
    engine = create_engine(sqlite_url, poolclass=NullPool)
    with engine.connect() as conn:
        cells = [str(value) for table in inspect(conn).get_table_names()
                 for row in conn.execute(text(f'SELECT * FROM "{table}"')) for value in row]
        hashes = set(conn.execute(text("SELECT token_sha256 FROM autotune_tokens")).scalars())
    engine.dispose()
    for token in tokens.values():
        assert token.startswith(TOKEN_PREFIX) and len(token) == len(TOKEN_PREFIX) + 43
        assert not any(token in cell or token[len(TOKEN_PREFIX):] in cell for cell in cells)
        assert hashlib.sha256(token.encode()).hexdigest() in hashes
    db_file = Path(sqlite_url.removeprefix("sqlite:///"))
    for path in db_file.parent.glob(db_file.name + "*"):  # the database, its WAL and shm files
        assert not any(token.encode() in path.read_bytes() for token in tokens.values()), path
    used = {t.name: t.last_used_at for t in store.tokens()}
    assert used["test-admin"] is not None and used["test-worker"] is None


def test_auth_off_lets_everyone_write(sqlite_url: str) -> None:
    with TestClient(create_app(make_settings(sqlite_url))) as client:  # the helper's default: auth off
        assert client.post("/v1/studies", json=SPEC).status_code == 201
        assert client.post("/v1/trials/lease", json=LEASE).status_code == 200


def test_starting_with_auth_on_and_no_token_warns_how_to_create_one(sqlite_url: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="autotune.api.auth"), \
            TestClient(create_app(make_settings(sqlite_url, auth=True))):
        pass
    assert "has no active token" in caplog.text and "autotune token create --role admin" in caplog.text
    caplog.clear()
    store = TokenStore.open(sqlite_url)
    store.create("worker")
    store.close()
    with caplog.at_level("WARNING", logger="autotune.api.auth"), \
            TestClient(create_app(make_settings(sqlite_url, auth=True))):
        pass
    assert "no active token" not in caplog.text


def test_the_openapi_schema_declares_the_bearer_scheme_on_writes_only(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    paths = schema["paths"]
    assert paths["/v1/studies"]["post"]["security"] == [{"HTTPBearer": []}]
    assert paths["/v1/trials/lease"]["post"]["security"] == [{"HTTPBearer": []}]
    assert "security" not in paths["/v1/studies"]["get"] and "security" not in paths["/v1/health"]["get"]


def cli(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotune.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200", **kw.pop("env", {})}, **kw)


@pytest.mark.slow
def test_cli_tokens_work_over_real_http_and_refusals_reach_client_and_worker(db_url: str) -> None:
    done = cli("token", "create", "--role", "admin", "--name", "ops", "--db", db_url)
    assert done.returncode == 0, done.stderr
    admin_token = done.stdout.strip()
    assert admin_token.startswith(TOKEN_PREFIX) and "shown only this once" in done.stderr

    app = create_app(make_settings(db_url, auth=True))
    with serve(app) as base_url:
        assert httpx.post(f"{base_url}/v1/studies", json=SPEC).status_code == 401
        assert httpx.post(f"{base_url}/v1/studies", json=SPEC, headers=bearer(admin_token)).status_code == 201
        with Client(base_url, admin_token, retry_for_s=1.0) as client:
            assert client.stop_study("s").state == "stopped"
        with Client(base_url, "at_not-a-token", retry_for_s=1.0) as client, pytest.raises(Unauthorized) as refused:
            client.create_study(StudySpec.model_validate({**SPEC, "name": "t"}))
        assert refused.value.status_code == 401 and "autotune token create --role admin" in refused.value.message

        # a worker whose token the service refuses exits 1 with the service's message
        worker = cli("worker", "--api", base_url, "--max-trials", "1", env={"AUTOTUNE_TOKEN": admin_token[:-2]})
        assert worker.returncode == 1, worker.stdout + worker.stderr
        assert "the service refused the lease" in worker.stdout and "autotune token create --role worker" in \
            worker.stdout.replace("\n", " ")

        revoked = cli("token", "revoke", "ops", "--db", db_url)
        assert revoked.returncode == 0 and "revoked admin token 'ops'" in revoked.stdout
        time.sleep(app.state.settings.token_cache_s + 0.2)
        assert httpx.post(f"{base_url}/v1/studies", json={**SPEC, "name": "u"},
                          headers=bearer(admin_token)).status_code == 401
    listing = cli("token", "list", "--db", db_url)
    assert listing.returncode == 0 and "ops" in listing.stdout and admin_token not in listing.stdout


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                                ("127.0.0.2", True), ("0.0.0.0", False), ("::", False),
                                                ("10.1.2.3", False), ("myhost.example", False)])
def test_only_loopback_addresses_count_as_local(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_serve_refuses_a_non_loopback_address_without_auth(tmp_path: Path) -> None:
    from autotune.api.main import ServeRefused
    from autotune.api.settings import Settings

    check_listen("0.0.0.0", Settings(db_url="sqlite://", auth=True))  # auth on: anywhere
    check_listen("127.0.0.1", Settings(db_url="sqlite://", auth=False))  # auth off: loopback only
    with pytest.raises(ServeRefused, match=r"refusing to serve on 0\.0\.0\.0 without authentication"):
        check_listen("0.0.0.0", Settings(db_url="sqlite://", auth=False))
    db = tmp_path / "refused.db"
    done = cli("serve", "--no-auth", "--host", "0.0.0.0", "--db", f"sqlite:///{db}", "--port", "1")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "refusing to serve on 0.0.0.0 without authentication" in done.stderr
    assert "autotune token create" in done.stderr
    assert not db.exists()  # refused before touching anything
    done = cli("serve", "--host", "10.0.0.1", "--db", f"sqlite:///{db}", "--port", "1", env={"AUTOTUNE_AUTH": "false"})
    assert done.returncode == 2 and "without authentication" in done.stderr


def test_a_setting_the_service_cannot_read_is_a_usage_error_naming_the_variable(tmp_path: Path) -> None:
    """AUTOTUNE_AUTH=maybe was a traceback from pydantic; now exit 2 before the database is touched,
    naming the variable and its value. An option given on the command line overrides it."""
    db = tmp_path / "s.db"
    done = cli("serve", "--db", f"sqlite:///{db}", "--port", "1", env={"AUTOTUNE_AUTH": "maybe"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: $AUTOTUNE_AUTH: 'maybe': Input should be a valid boolean" in done.stderr
    assert "Traceback" not in done.stderr and not db.exists()
    done = cli("db", "upgrade", env={"AUTOTUNE_DB_URL": f"sqlite:///{db}", "AUTOTUNE_LEASE_GRACE_S": "-1"})
    assert done.returncode == 2 and "$AUTOTUNE_LEASE_GRACE_S: '-1': Input should be greater than 0" in done.stderr
    with pytest.raises(SettingsError, match=r"^auth: 'maybe'"):  # a keyword the caller gave: named as such
        from_environment(auth="maybe")


def test_token_names_and_roles_are_checked(store: TokenStore) -> None:
    from autotune.api.errors import Conflict, Invalid, NotFound

    with pytest.raises(Invalid, match="role 'root' is not allowed"):
        store.create("root")
    with pytest.raises(Invalid, match="all digits"):
        store.create("worker", "42")
    with pytest.raises(Invalid, match="not allowed"):
        store.create("worker", "has space")
    _, info = store.create("worker", "w")
    with pytest.raises(Conflict, match="exists already"):
        store.create("admin", "w")
    assert store.revoke(str(info.id)).revoked_at is not None  # by id
    with pytest.raises(NotFound):
        store.revoke("nobody")
    assert store.create("worker")[1].name.startswith("worker-")  # a default name
