"""Helpers shared by the benchmarks: a free port, the hardware class a worker on a device
reports, the run's environment, waiting for a freshly started service, and running
`autotune probe` as a worker runs its probes (`run_cli`), the code a run measured (`code_version`),
and a study benchmark's last step (`finish_run`)."""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from autotune.engine.fork_server import ForkServer
from autotune.engine.host_telemetry import cpu_model
from autotune.worker.detect import run_python
from autotune.worker.hardware import installed_torch_version


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def hardware_class(device: str) -> str:
    """What a worker on `device` reports as its hardware class: "cpu", or the GPU's name."""
    if device == "cpu":
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(torch.device(device)))


def torch_version() -> str:
    """torch's version, as ``torch.__version__`` says it, without importing torch in a process
    that has not: the version its installed distribution records (the same string). A harness
    on a CPU never needs torch otherwise, and the import costs it 1.5-2 CPU-seconds."""
    if "torch" not in sys.modules:
        version = installed_torch_version()
        if version is not None:
            return version
    import torch  # already imported (free), or the fallback: not a distribution, ask torch

    return str(torch.__version__)


def environment(device: str) -> dict[str, Any]:
    gpu = hardware_class(device)  # on a GPU its name: torch is imported, and its own version is read below
    return {"python": platform.python_version(), "torch": torch_version(), "device": device,
            "gpu": gpu, "host": platform.node(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


@functools.cache
def http() -> httpx.Client:
    """One HTTP client for a script's REST calls, made at the first: httpx's module-level
    functions build a client, TLS context included, per call (25-40 ms of CPU, many times a
    second in a polling loop), and a script that makes none needs none. No keep-alive: each
    request opens its own connection (a restarted service leaves none stale)."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def wait_healthy(http: httpx.Client, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Return once GET /v1/health answers 200; exit if the service process dies or never does."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the service exited with {proc.returncode}; see its log")
        try:
            if http.get("/v1/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the service did not become healthy")


_FORK_SERVERS: dict[tuple[tuple[str, str], ...], ForkServer] = {}


def run_cli(args: list[str], env: Mapping[str, str] | None = None, timeout: float | None = None,
            warm: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m autotune.cli ARGS`` (an `autotune probe --json`, say) as a worker starts its
    probe children: forked from a fork server (autotune/engine/fork_server.py) that imported torch
    once, one server per environment for the harness's whole run; each probe is still a
    process of its own (its own CUDA context, compile state and memory), forked once the server
    has imported everything a probe does (`run_python`'s `preloaded`). ``warm=False`` (for
    an environment used once) or AUTOTUNE_WARM_START=0 starts a fresh interpreter instead.
    Raises subprocess.TimeoutExpired past `timeout` s."""
    environment = dict(os.environ if env is None else env)
    server = None
    if warm and os.environ.get("AUTOTUNE_WARM_START", "1").lower() not in ("0", "false", "no") \
            and sys.platform.startswith("linux"):
        key = tuple(sorted(environment.items()))
        server = _FORK_SERVERS.get(key)
        if server is None:
            server = _FORK_SERVERS[key] = ForkServer(environment).start()
            atexit.register(server.close)
    code, out, err = run_python(["-m", "autotune.cli", *args], server, timeout, env=environment, preloaded=True)
    return subprocess.CompletedProcess(["autotune", *args], code, out, err)


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (benchmarks write PNGs, never open windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


ROOT = Path(__file__).resolve().parents[1]


# What a run's numbers depend on, as files: the product (autotune/ and the folders it links to),
# the benchmarks' own scripts, the example jobs. Read from the disk, not from git.
SOURCE_FOLDERS = ("autotune", "api", "migrations", "search_spaces", "bench", "examples")
SOURCE_SUFFIXES = (".py", ".yaml", ".toml")
SKIPPED_FOLDERS = ("__pycache__", "results", "build")


def source_digest(root: Path = ROOT) -> str:
    """sha256 over the source files under `root`'s SOURCE_FOLDERS (each file's relative path and
    bytes, in path order; links, caches, results and build output skipped): the code a run
    measured even where a copy's git metadata is stale (the GPU machine's copy of the working tree
    read an older commit). Compare a run with a commit by calling this in that commit's checkout."""
    digest = hashlib.sha256()
    files = []
    for folder in SOURCE_FOLDERS:
        for parent, dirs, names in os.walk(root / folder):  # links to folders are not followed
            dirs[:] = [d for d in dirs if d not in SKIPPED_FOLDERS and not d.endswith(".egg-info")]
            files += [Path(parent) / n for n in names if n.endswith(SOURCE_SUFFIXES)]
    for path in sorted(p for p in files if not p.is_symlink()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def code_version() -> dict[str, Any]:
    """The code a run measures: the commit checked out, the files changed since (read-only git
    calls) and `source_digest`, which holds where the git metadata does not."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {"commit": git("rev-parse", "HEAD").strip() or None, "changed_files": changed,
            "source_sha256": source_digest()}


def finish_run(out: Path, doc: dict[str, Any], png: Path, draw: Callable[[], None], table: str,
               studies: list[dict[str, Any]], log_tail: str) -> int:
    """A study benchmark's end: the JSON (compact), the PNG, the table; 1 when a study did not finish."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, separators=(",", ":")))
    draw()
    print()
    print(table)
    print(f"\nwrote {out} and {png} ({doc['wall_s']:.0f} s)")
    unfinished = [s["study"] for s in studies if not s["finished"]]
    if unfinished:
        print(f"{len(unfinished)} studies did not finish: {', '.join(unfinished[:10])}\nservice log:\n{log_tail}",
              file=sys.stderr)
        return 1
    return 0
