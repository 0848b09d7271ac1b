"""A third party's own training job, tuned end to end through the real service and real workers.

The workloads live only in a package this test writes to a temporary directory (never in
autotune): a small classifier with its own data, loss, optional auxiliary term and quality
metric. Two ways in, as the tutorial (docs/tutorial.md) shows:

* an installed distribution registering ``toywl`` under the entry-point group
  ``autotune.workloads`` (service and worker have it on their path); its metric is
  ``val_loss`` (minimize) and the study does not name it: the first result does;
* an import path on the worker's command line only (``--allow-workload
  toyacc=toy_workloads:AccuracyWorkload``), with the service told the name only
  (``AUTOTUNE_WORKLOADS=toyacc``); its metric is ``val_accuracy``, to *maximize*, which the
  study declares (``quality: {metric, direction}``), so the gate judges from below.

Each study finishes with a recommendation whose quality is that workload's metric; nothing
calls it NRMSE. A study is the baseline and one search trial, a starting point that differs
from the baseline (the auxiliary term every second step): the sampler's own first draw on
this small space is the baseline's config again, never a candidate, so the starting point
spares a study that third probe.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from live_service import LiveService, Processes, log_text, small_spec, start_worker

from autotune.contract.registry import ENTRY_POINT_GROUP

MODULE = "toy_workloads"
SOURCE = '''
"""A third party's workloads: a classifier on a fixed synthetic problem."""
import torch
from torch import nn
from torch.utils.data import Dataset

from autotune.contract.registry import TrainingDefaults, Workload


class Points(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, :4].sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 2))

    def forward(self, batch, with_aux=True):
        logits = self.net(batch["x"])
        ce = nn.functional.cross_entropy(logits.float(), batch["y"])
        out = {"ce": ce, "total": ce}
        if with_aux:  # the optional expensive term: a logit penalty
            out["penalty"] = logits.float().pow(2).mean()
            out["total"] = ce + 1e-3 * out["penalty"]
        return out


class LossWorkload(Workload):
    name = "toywl"
    quality_metric = "val_loss"
    aux_loss_name = "penalty"

    def __init__(self, preset):
        self.preset = preset

    @property
    def defaults(self):
        return TrainingDefaults(batch_size=4, accum_steps=1, lr=1e-2, samples=64)

    def build_model(self):
        return Classifier()

    def datasets(self, seed):
        return Points(256, 1), Points(128, 2)

    @torch.no_grad()
    def evaluate(self, model, val, device):
        x, y = val.x.to(device), val.y.to(device)
        return float(nn.functional.cross_entropy(model.net(x), y))


class AccuracyWorkload(LossWorkload):
    name = "toyacc"
    quality_metric = "val_accuracy"
    quality_direction = "maximize"

    @torch.no_grad()
    def evaluate(self, model, val, device):
        x, y = val.x.to(device), val.y.to(device)
        return float((model.net(x).argmax(1) == y).float().mean())
'''


def write_package(site: Path, entry_point: bool) -> Path:
    site.mkdir(parents=True)
    (site / f"{MODULE}.py").write_text(SOURCE)
    if entry_point:
        info = site / "toy_workloads-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-workloads\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntoywl = {MODULE}:LossWorkload\n")
    return site


# the first search trial: a candidate (a config other than the baseline's, SMALL_BASELINE)
CANDIDATE = [{"batch_size": 4, "inverse_loss_frequency": 2}]
N_TRIALS = 2  # the baseline and the candidate


def _path(site: Path) -> str:
    return os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.mark.slow
def test_third_party_workloads_are_tuned_on_their_own_metric(processes: Processes, tmp_path: Path) -> None:
    plugin = write_package(tmp_path / "installed", entry_point=True)
    module_only = write_package(tmp_path / "module-only", entry_point=False)
    service = LiveService(processes, tmp_path / "autotune.db",
                          env={"PYTHONPATH": _path(plugin), "AUTOTUNE_WORKLOADS": "toyacc"}).start()

    # the entry-point workload: the study does not name the metric; the workload's result does.
    # No pruning: the two studies' workers share this host's cores, so a trial's throughput
    # follows the other's load, and the throughput rule could stop it (the metric is under test)
    service.submit(small_spec("by-entry-point", n_trials=N_TRIALS, workload="toywl", preset="any",
                              starting_points=CANDIDATE, pruning={"enabled": False}))
    # the command-line workload: the service knows only its name, the study declares the metric
    service.submit(small_spec("by-import-path", n_trials=N_TRIALS, workload="toyacc", preset="any",
                              quality={"metric": "val_accuracy", "direction": "maximize"}, starting_points=CANDIDATE,
                              pruning={"enabled": False}))
    unknown = service.post("/v1/studies", small_spec("nope", workload="toyxyz"))
    assert unknown.status_code == 422 and "AUTOTUNE_WORKLOADS" in unknown.text

    first = start_worker(processes, service.url, "--study", "by-entry-point", "--allow-workload", "toywl",
                         "--max-trials", str(N_TRIALS), log_name="worker-ep.log", env={"PYTHONPATH": _path(plugin)})
    second = start_worker(processes, service.url, "--study", "by-import-path", "--allow-workload",
                          f"toyacc={MODULE}:AccuracyWorkload", "--max-trials", str(N_TRIALS),
                          log_name="worker-path.log", env={"PYTHONPATH": _path(module_only)})
    for worker in (first, second):
        assert worker.wait(timeout=240) == 0, log_text(worker)[-4000:]

    for study, metric, direction in (("by-entry-point", "val_loss", "minimize"),
                                     ("by-import-path", "val_accuracy", "maximize")):
        trials = service.trials(study)
        assert [t["state"] for t in trials] == ["COMPLETE"] * N_TRIALS, (trials, log_text(first)[-3000:])
        assert all(t["quality_metric"] == metric and t["val_nrmse"] is None for t in trials)
        assert all(t["feasible"] is not None for t in trials)
        best = service.get(f"/v1/studies/{study}/best")
        assert best["quality_metric"] == metric and best["quality_direction"] == direction
        assert best["val_nrmse"] is None and best["gate_nrmse"] is None and best["baseline_val_nrmse"] is None
        base = best["baseline_quality"]
        if direction == "maximize":
            assert 0.5 < best["quality"] <= 1.0 and best["gate_quality"] == pytest.approx(base - 0.01)
            assert best["quality"] >= best["gate_quality"]
        else:
            assert best["quality"] > 0 and best["gate_quality"] == pytest.approx(base + 0.01)
            assert best["quality"] <= best["gate_quality"]
        yaml_text = service_text(service, f"/v1/studies/{study}/best?format=yaml")
        assert f"# {metric}: " in yaml_text and "nrmse" not in yaml_text.lower()


def service_text(service: LiveService, path: str) -> str:
    import httpx

    response = httpx.get(f"{service.url}{path}", timeout=10)
    response.raise_for_status()
    return response.text
