"""The package as a user installs it: a wheel built from the repository, installed into a fresh
virtual environment that has the dependencies but not the sources, serves, tunes a tiny study
and finds the demo's search space. Nothing is installed as a top-level `api` or `migrations`."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest
import yaml
from live_service import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "name": "from-the-wheel", "sampler": "grid", "seed": 0, "n_trials": 2, "baseline_seeds": 1,
    "space": {"params": {"batch_size": {"choices": [4, 8]}}, "fixed": {"accum_steps": 1}},
    "baseline": {"batch_size": 4, "accum_steps": 1},
    "probe": {"samples": 160, "windows": 5, "warmup_steps": 5}, "remeasure": {"top_k": 0},  # the tune, not its verdict
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed (no deps: they come from this venv's site-packages
    through a .pth line, which adds the folder but runs none of its .pth files, so the editable
    install of the repository stays out). Its bin/ folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300,
                           check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp / "dist").glob("autotune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"autotune"}, tops  # no top-level api, migrations or search_spaces
    assert {"autotune/api/main.py", "autotune/migrations/env.py", "autotune/migrations/script.py.mako",
            "autotune/search_spaces/cpu.yaml"} <= set(names)

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after pip: its own stays its own
    return venv / "bin"


def run(bin_dir: Path, *args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AUTOTUNE_SPACES_DIR")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_the_wheel_holds_one_package_that_imports_from_itself(installed: Path, tmp_path: Path) -> None:
    done = run(installed, str(installed / "python"), "-c",
               "import importlib.util as u, autotune, autotune.api.main, autotune.migrations\n"
               "import autotune.contract.space as s, autotune.api.db as db\n"
               "print(autotune.__file__); print(autotune.api.__file__); print(s.SPACES_DIR); print(db.MIGRATIONS_DIR)\n"
               "assert u.find_spec('api') is None and u.find_spec('migrations') is None\n"
               "print(' '.join(s.space_names()))", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    *paths, spaces = done.stdout.splitlines()
    for path in paths:
        assert not Path(path).is_relative_to(ROOT), done.stdout  # the installed copy, not the repository
    assert set(spaces.split()) == {p.stem for p in (ROOT / "search_spaces").glob("*.yaml")}


@pytest.mark.slow  # ~25 s on 2 cores: a real study of two probes
def test_the_installed_wheel_serves_tunes_and_finds_the_demo_space(installed: Path, tmp_path: Path) -> None:
    # serve: migrates its database from the migrations inside the package and answers
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{installed}{os.pathsep}{env['PATH']}"
    server = subprocess.Popen([str(installed / "autotune"), "serve", "--port", str(port), "--db",
                               f"sqlite:///{tmp_path / 'serve.db'}"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, server.communicate()[0]
            time.sleep(0.2)
    finally:
        server.terminate()
        server.wait(timeout=30)

    # demo: the built-in space ships with the package (too few samples is the only complaint)
    demo = run(installed, str(installed / "autotune"), "demo", "--samples", "100", "--workdir", "d", cwd=tmp_path)
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert "at least 832 samples" in demo.stderr and "no search space" not in demo.stderr, demo.stderr

    # tune: one command, a tiny study, a verdict and best.yaml
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(TINY))
    tuned = run(installed, str(installed / "autotune"), "tune", "spec.yaml", "--workers", "1", cwd=tmp_path,
                timeout=400)
    assert tuned.returncode in (0, 1), tuned.stdout[-3000:] + tuned.stderr[-3000:]
    assert "verdict" in tuned.stdout.lower()
    assert (tmp_path / "best.yaml").read_text().startswith("# autotune verdict for study from-the-wheel: ")
