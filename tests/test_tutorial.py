"""docs/tutorial.md works: every ```bash block, in order, as one script, on a CPU.

The script runs in a temporary copy of examples/ (so its database, best.yaml and build
files stay out of the repository), with the virtual environment's `autotune`, `python` and
`pip` first on PATH. Two substitutions keep the run hermetic, and nothing else is changed:

* ``pip install X`` installs into a temporary directory put on PYTHONPATH (``--target``,
  ``--no-deps --no-build-isolation``: no network, the test venv left unchanged);
* the service's port 8765 becomes a free port.

Its processes inherit the suite's one torch thread (OMP_NUM_THREADS=1, tests/conftest.py),
as the tutorial's workers run (`--threads 1`).

Real processes throughout: `autotune serve` with token auth, a real worker and probe
children, the example package's entry point, and the job's own training loop with
`autotune.apply`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import bash_blocks
from live_service import free_port

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial.md"


def tutorial_script(site: Path, port: int) -> str:
    blocks = bash_blocks(TUTORIAL.read_text())
    body = "\n".join(blocks)
    body = re.sub(r"\bpip install ", f"pip install -q --no-deps --no-build-isolation --target {site} ", body)
    body = body.replace("8765", str(port))
    # stop whatever the script left running (the service) even when a command fails
    return f"set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n{body}\n"


def test_the_tutorial_has_the_steps_it_promises() -> None:
    script = "\n".join(bash_blocks(TUTORIAL.read_text()))
    for step in ("pip install ./examples/my_workload", "autotune token create --role admin",
                 "autotune serve", "autotune submit", "--allow-workload my-wl", "autotune best",
                 "python -m my_workload.train --config best.yaml",
                 # part 2: a script as people write it, its workload glue and the apply path
                 "python examples/gpt_script/gpt_script/train.py", "pip install ./examples/gpt_script",
                 "autotune probe --workload gpt-script --preset tiny --json", "--allow-workload gpt-script",
                 "python -m gpt_script.train --config gpt-best.yaml"):
        assert step in script, step


@pytest.mark.slow
def test_the_tutorial_commands_run_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", reason="pip install --no-build-isolation builds the example with the venv's "
                                             "setuptools: pip install setuptools")
    work = tmp_path / "work"
    shutil.copytree(ROOT / "examples", work / "examples", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    site = tmp_path / "site"
    script = tutorial_script(site, free_port())
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "AUTOTUNE_TOKEN": "", "AUTOTUNE_DB_URL": "", "AUTOTUNE_API": ""}
    done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=1200,
                          stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    serve_log = (work / "serve.log").read_text() if (work / "serve.log").exists() else ""
    assert done.returncode == 0, output[-6000:] + "\n--- serve.log ---\n" + serve_log[-3000:]
    assert "val_loss" in output and "None" in output  # the probe: quality_metric, its value, no failure
    best = (work / "best.yaml").read_text()
    assert "# autotune verdict for study my-first-study" in best
    assert "# val_loss: " in best and "nrmse" not in best.lower()
    # 16 x 1 trains 8 x 2's steps (its val_loss the baseline's seed for seed) faster on a quiet core; whether the
    # rounds show that beyond the noise depends on the host's load (a test does not time things). It is always
    # re-measured (the study's top_k 3 takes every feasible config but the baseline's: a CI run of 2026-11-29 on a
    # loaded host measured 16 x 1 slower than two others in the search, and top_k 2 left it out)
    assert any(abs(float(d)) < 1e-6 for d in re.findall(r"val_loss difference ([+-]\S+) \(bound", best)), best
    if ": CERTIFIED" in best:
        assert re.search(r"^batch_size: 16\naccum_steps: 1$", best, flags=re.MULTILINE), best
    else:
        assert "KEEP THE BASELINE (undecided)" in best and re.search(r"^batch_size: 8\naccum_steps: 2$", best,
                                                                      flags=re.MULTILINE), best
    assert re.search(r"epoch 1: val_loss \d+\.\d+", output), output[-3000:]
    # part 2: the script's probe trained with its optimizer and schedule; its study and apply path ran
    assert re.search(r"^AdamW \(\d+ tensors in 2 groups\)$", output, flags=re.MULTILINE), output[-3000:]
    assert "ScriptWorkload.lr_multiplier" in output
    assert "# autotune verdict for study gpt-script-study" in (work / "gpt-best.yaml").read_text()
    assert len(re.findall(r"parameters, vocab \d+, \d+ iterations of \d+ x \d+ sequences", output)) == 2, output[-3000:]
    # the apply path timed the script's own loop and set the study's figure for the pick beside it
    assert re.search(r"your loop: [\d,.]+ samples/s over optimizer steps 11-\d+ .*; the study's probe measured "
                     r"[\d,.]+ for this config \([\d.]+x\)", output), output[-3000:]
