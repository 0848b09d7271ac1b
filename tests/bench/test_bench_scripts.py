"""The GPU benchmarks' drivers, run small on a CPU so that they cannot go stale unnoticed
between GPU sessions (their figures come from the same code on a lent GPU): probe_configs.py
with report_probe.py, pruning.py's study and analysis, step_graph.py, ddp.py and optimizer_step.py.

The runs check the scripts' wiring, not their numbers: a run's probes train just enough samples
for its largest batch to have 5 warm-up and 5 timed optimizer steps, on one torch thread each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, run_bench

pytestmark = pytest.mark.slow



def _run(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_bench(script, *args, cwd=cwd)


# Two configs, each probed once: a micro-batch of 4 accumulated twice (the tiny preset's own
# shape) and one of 8 (effective batch 8 both: 80 samples are 10 steps of each)
PROBE_CONFIGS = '{"baseline": {"batch_size": 4, "accum_steps": 2}, "b8": {"batch_size": 8, "accum_steps": 1}}'


def _probe_configs(preset: str, out: Path) -> Path:
    _run("probe_configs.py", ["--preset", preset, "--device", "cpu", "--samples", "80", "--repeats", "1",
                              "--configs", PROBE_CONFIGS, "--out", str(out)], out.parent)
    return out


@pytest.fixture(scope="module")
def tiny_probes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """probe_configs.py over PROBE_CONFIGS on the tiny preset, run once for the module: the
    probe_configs test checks and reports it, the optimizer-step test tables it beside its
    tiny-muon run (a run costs about 7 CPU-seconds: the script, its fork server, two probes)."""
    return _probe_configs("tiny", tmp_path_factory.mktemp("probe-configs") / "tiny.json")


def test_probe_configs_probes_each_config_in_its_own_process_and_reports_them(tmp_path: Path,
                                                                              tiny_probes: Path) -> None:
    runs = json.loads(tiny_probes.read_text())["runs"]
    assert [(r["name"], r["config"]["batch_size"]) for r in runs] == [("baseline", 4), ("b8", 8)]
    assert all(r["failure"] is None and r["throughput_samples_per_s"] > 0 and r["samples_trained"] == 80
               for r in runs)
    png = tmp_path / "probes.png"
    table = _run("report_probe.py", [str(tiny_probes), "--png", str(png)], tmp_path).stdout
    assert "| baseline |" in table and "| b8 |" in table and png.stat().st_size > 0


def test_the_harness_records_torchs_version_without_importing_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """studylib.environment, in a harness that has not imported torch (a CPU run's: the import
    would cost it 1.5-2 CPU-seconds), records the version torch's distribution does: the same
    string as torch.__version__."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import studylib  # a bench module (bench/ is not a package)

    monkeypatch.delitem(sys.modules, "torch")  # as in a process that never imported it (put back after)
    assert studylib.environment("cpu")["torch"] == torch.__version__
    assert "torch" not in sys.modules  # read without importing it


def test_the_source_digest_follows_the_sources_and_nothing_else(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """studylib.source_digest names the code a run measured from the files themselves (the GPU
    machine's copy had stale git metadata): a source's bytes or name change it; caches, results,
    build output and the links into the product's folders do not."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import studylib

    for name, text in {"autotune/a.py": "A = 1\n", "api/b.py": "B = 2\n", "search_spaces/cpu.yaml": "x: 1\n",
                       "bench/run.py": "", "autotune/__pycache__/a.py": "", "bench/results/r.yaml": "",
                       "examples/job/build/lib/j.py": "", "README.md": ""}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "autotune" / "api").symlink_to("../api")
    first = studylib.source_digest(tmp_path)
    assert studylib.source_digest(tmp_path) == first
    for name in ("autotune/__pycache__/a.py", "bench/results/r.yaml", "examples/job/build/lib/j.py", "README.md"):
        (tmp_path / name).write_text("changed")
        assert studylib.source_digest(tmp_path) == first, name
    (tmp_path / "api" / "b.py").write_text("B = 3\n")
    changed = studylib.source_digest(tmp_path)
    assert changed != first
    (tmp_path / "api" / "b.py").rename(tmp_path / "api" / "c.py")
    assert studylib.source_digest(tmp_path) not in (first, changed)
    assert len(studylib.source_digest()) == 64 and studylib.code_version()["source_sha256"] == studylib.source_digest()


# The cpu space's knobs with smaller batches (effective batch <= 8, inverse-loss period <= 2), so
# that a probe of 96 samples has its 5 warm-up and 5 timed steps at every point of the space; a
# YAML file, as the benchmark's own space (bench/configs/pruning_space.yaml) is sent.
SMALL_CPU_SPACE = """name: cpu-small
params:
  batch_size: {choices: [2, 4]}
  accum_steps: {choices: [1, 2]}
  inverse_loss_frequency: {choices: [1, 2]}
  precision: {choices: [fp32, bf16]}
  checkpoint: {choices: [none, block]}
  fused_optimizer: {choices: [false, true]}
fixed:
  num_workers: 0
  pin_memory: false
"""


def test_pruning_study_runs_on_the_service_and_is_analyzed(tmp_path: Path) -> None:
    run = tmp_path / "study"
    space = tmp_path / "space.yaml"
    space.write_text(SMALL_CPU_SPACE)
    # the budget is a ceiling only: the study ends when its 5 trials are done, however slow the host
    _run("pruning.py", ["study", "--dir", str(run), "--budget-s", "280", "--device", "cpu", "--space", str(space),
                        "--preset", "tiny", "--samples", "96", "--n-trials", "5", "--poll-s", "0.5"], tmp_path)
    out = tmp_path / "pruning.json"
    _run("pruning.py", ["analyze", "--dir", str(run), "--out", str(out)], tmp_path)
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert summary["trials"] == len(doc["trials"]) >= 5 and summary["failed"] == 0
    assert len(summary["baseline_nrmse"]) == 3 and summary["gate_nrmse"] > 0
    assert summary["pruned"] == len(doc["pruned"]) and summary["gpu_s_spent"] > 0


def test_step_graph_pairs_each_config_off_and_on(tmp_path: Path) -> None:
    out = tmp_path / "graph.jsonl"
    printed = _run("step_graph.py", ["--preset", "tiny", "--device", "cpu", "--samples", "80", "--out", str(out),
                                     "--config", '{"batch_size": 8, "accum_steps": 1}'], tmp_path).stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["knobs"]["step_graph"] for r in rows] == [False, True]
    assert rows[0]["step_graph"] == "off" and rows[1]["step_graph"].startswith("inactive on cpu")
    assert all(r["failure"] is None and r["throughput"] > 0 for r in rows) and "samples/s, NRMSE" in printed
    assert rows[0]["val_nrmse"] == rows[1]["val_nrmse"]  # inactive: the same training
    sys.path.insert(0, str(ROOT / "bench"))
    from step_graph import graphed  # the bench script (bench/ is not a package)

    assert graphed({"compile": "reduce-overhead", "batch_size": 8}) == {"compile": "default", "batch_size": 8,
                                                                         "step_graph": True}
    assert graphed({"compile": "none"}) == {"compile": "none", "step_graph": True}


def test_ddp_runs_one_and_two_rank_probes_as_the_worker_launches_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ddp.json"
    _run("ddp.py", ["--device", "cpu", "--preset", "tiny", "--samples", "80",
                    "--only", "1gpu-accum1,2gpu-accum1-bucket25", "--out", str(out)], tmp_path)
    doc = json.loads(out.read_text())
    assert [(r["name"], r["gpus"]) for r in doc["rows"]] == [("1gpu-accum1", 1), ("2gpu-accum1-bucket25", 2)]
    one, two = (r["result"] for r in doc["results"])
    assert (one["world_size"], two["world_size"]) == (1, 2) and two["knobs"]["parallel"] == "ddp: 2 ranks (gloo)"
    assert two["config"]["bucket_cap_mb"] == 25.0 and one["samples_trained"] == two["samples_trained"] == 80
    single, pair = doc["rows"]
    assert pair["scaling_efficiency"] == pytest.approx(pair["throughput"] / (2 * single["throughput"]), abs=1e-4)
    assert out.with_suffix(".png").stat().st_size > 0
    # an unknown case is refused before anything runs (in this process: the script's own main)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import ddp  # the bench script (bench/ is not a package)

    monkeypatch.setattr(sys, "argv", ["ddp.py", "--only", "3gpu", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit) as refused:
        ddp.main()
    assert refused.value.code == 2
    assert "--only: no case named 3gpu; the cases are 1gpu-accum1," in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_optimizer_step_runs_the_probe_and_the_apply_loop_and_tables_them(tmp_path: Path, tiny_probes: Path) -> None:
    """The user's-step benchmark on a CPU: probe_configs.py for both ups optimizers (the tiny
    preset's run is the module's), then optimizer_step.py's mirrored probe / apply loop / probe
    and its table and chart. The loop times half a second: only its wiring is checked,
    and it times at least one step however slow the host (its clock starts just before the first)."""
    probes = [str(tiny_probes), str(_probe_configs("tiny-muon", tmp_path / "tiny-muon.json"))]
    loop = tmp_path / "loop.json"
    _run("optimizer_step.py", ["loop", "--preset", "tiny-muon", "--device", "cpu", "--samples", "80",
                               "--config", '{"batch_size": 8, "accum_steps": 1}', "--seconds", "0.5",
                               "--warmup-steps", "2", "--out", str(loop)], tmp_path)
    doc = json.loads(loop.read_text())
    assert [r["kind"] for r in doc["runs"]] == ["probe", "loop", "probe"]
    looped = doc["runs"][1]
    assert looped["steps"] > 0 and looped["throughput_samples_per_s"] > 0
    assert looped["notes"]["grad_clip"].startswith("max norm 1 ")  # the workload's clipping, through apply
    assert looped["notes"]["fused_optimizer"].startswith("Muon: inactive")  # the workload's own hybrid
    assert doc["probe_over_loop"] > 0
    png = tmp_path / "step.png"
    table = _run("optimizer_step.py", ["table", "--probes", *probes, "--loops", str(loop), "--png", str(png)],
                 tmp_path).stdout
    assert "| baseline | " in table and "| b8 | " in table and "tiny-muon: samples/s" in table
    assert "tiny-muon, apply loop" in table and png.stat().st_size > 0


def test_probe_start_compares_cold_children_with_forked_ones(tmp_path: Path) -> None:
    out, png = tmp_path / "start.json", tmp_path / "start.png"
    _run("probe_start.py", ["--device", "cpu", "--preset", "tiny", "--samples", "40", "--config",
                            '{"batch_size": 4, "accum_steps": 1}', "--repeats", "2", "--skip", "1", "--threads", "1",
                            "--out", str(out), "--png", str(png)], tmp_path)
    data = json.loads(out.read_text())
    assert [(r["mode"], r["repeat"], r["forked"]) for r in data["runs"]] == [
        ("cold", 0, False), ("warm", 0, True), ("cold", 1, False), ("warm", 1, True)]
    assert all(r["overhead_s"] > 0 and r["throughput"] > 0 for r in data["runs"])
    assert {data["summary"][m]["runs"] for m in ("cold", "warm")} == {1}  # the first run of each left out
    assert data["server_preload_s"] > 0 and png.stat().st_size > 0
