"""An idle worker names the running studies it cannot take, and why, once (issue 23, item 8).

* live: a real service holding only a study of hardware "NVIDIA H100 80GB HBM3"; a CPU
  worker (any study, and one pinned to it) idles and exits after --idle-exit, its output
  naming the study exactly once, with its hardware and the fix;
* in-process: a worker that polls many times (the recheck interval at 0) says a set once,
  and again only when the set changes; a service that cannot list studies gets no hint and
  the worker goes on;
* `skipped_studies`: each reason (hardware class either way, workload, gpus_per_trial) and
  what is not a skip (a study it can take, a finished or stopped one, another study than
  the pinned one).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from live_service import LiveService, Processes, log_text, small_spec, start_worker
from rich.console import Console

from autotune.contract.results import TrialLease
from autotune.worker import loop as worker_module
from autotune.worker.allow import skipped_studies
from autotune.worker.client import ServiceUnavailable
from autotune.worker.hardware import Hardware
from autotune.worker.loop import Worker
from autotune.worker.options import WorkerOptions

H100 = "NVIDIA H100 80GB HBM3"
CPU = Hardware(hardware_class="cpu", device="cpu", device_name="cpu (test)", memory_bytes=None,
               torch_version=torch.__version__, hostname="testhost", cpu_count=2)


# --- live: a real service, a real worker ---------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_study_service(tmp_path_factory: pytest.TempPathFactory, autotune_data_dir: Any) -> Iterator[LiveService]:
    tmp = tmp_path_factory.mktemp("hardware-hint")
    processes = Processes(tmp)
    try:
        service = LiveService(processes, tmp / "autotune.db").start()
        service.submit(small_spec("h100-only", n_trials=2, hardware=H100))
        yield service
    finally:
        processes.stop_all()


@pytest.mark.slow  # two worker starts on the module's live service: scheduled with the slow tests
def test_a_cpu_worker_names_the_gpu_study_it_skips_once(gpu_study_service: LiveService, tmp_path: Path) -> None:
    service = gpu_study_service
    processes = Processes(tmp_path)
    try:
        any_study = start_worker(processes, service.url, "--device", "cpu", "--idle-exit", "1",
                                 log_name="any.log")
        pinned = start_worker(processes, service.url, "--device", "cpu", "--idle-exit", "1", "--study", "h100-only",
                              log_name="pinned.log")
        for worker in (any_study, pinned):
            assert worker.wait(timeout=90) == 0, log_text(worker)[-3000:]
    finally:
        processes.stop_all()
    for worker in (any_study, pinned):
        out = log_text(worker)
        assert "exiting after 0 trial(s)" in out, out
        # once in all the output (a pinned worker's announcement names its study besides)
        assert out.count("h100-only") == (1 if worker is any_study else 2), out
        assert out.split("waiting for trials…", 1)[1].count("h100-only") == 1, out
        assert "1 running study this worker cannot take (its hardware class 'cpu', gpus_per_trial 1):" in out
        assert f"h100-only (hardware '{H100}'): a GPU study, and this worker runs on the cpu: start a worker " \
               "with --device cuda" in " ".join(out.split())
    assert service.trials("h100-only") == []


# --- in-process: said once per distinct set ------------------------------------------------------


def study(name: str, hardware: str = "cpu", state: str = "running", workload: str = "ups",
          gpus_per_trial: int = 1) -> dict[str, Any]:
    return {"name": name, "state": state,
            "spec": {"hardware": hardware, "workload": workload, "gpus_per_trial": gpus_per_trial}}


class Reply:
    def __init__(self, data: Any) -> None:
        self.data = data

    def json(self) -> Any:
        return self.data


class ListingClient:
    """Never has a trial; GET /v1/studies answers `listings` in turn (the last one repeats)."""

    base_url = "http://fake"

    def __init__(self, *listings: list[dict[str, Any]] | Exception) -> None:
        self.listings = list(listings)
        self.gets = 0

    def lease(self, request: Any, **kw: Any) -> TrialLease | None:
        return None

    def request(self, method: str, path: str, **kw: Any) -> Reply:
        assert (method, path) == ("GET", "/v1/studies")
        self.gets += 1
        listing = self.listings.pop(0) if len(self.listings) > 1 else self.listings[0]
        if isinstance(listing, Exception):
            raise listing
        return Reply({"data": listing, "count": len(listing)})

    def close(self) -> None:
        pass


def idle_run(client: ListingClient, hardware: Hardware = CPU) -> str:
    out = io.StringIO()
    worker = Worker(WorkerOptions(worker_id="w1", idle_exit_s=1.5), hardware, client=client,  # type: ignore[arg-type]
                    console=Console(file=out, width=300))
    assert worker.run() == 0
    return out.getvalue()


def test_each_distinct_set_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "SKIPPED_RECHECK_S", 0.0)  # reread the studies at every idle poll
    monkeypatch.setattr(worker_module, "IDLE_BACKOFF_CAP_S", 0.1)
    gpu, other_gpu = study("gpu-a", H100), study("gpu-b", "NVIDIA A100-SXM4-80GB")
    client = ListingClient([gpu], [gpu], [gpu, other_gpu], [gpu, other_gpu])
    out = idle_run(client)
    assert client.gets >= 5, client.gets  # many polls ...
    assert out.count("gpu-a (hardware") == 2 and out.count("gpu-b (hardware") == 1, out  # ... each set said once
    assert out.count("1 running study this worker cannot take") == 1
    assert out.count("2 running studies this worker cannot take") == 1


def test_no_hint_when_the_studies_cannot_be_read_or_none_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "SKIPPED_RECHECK_S", 0.0)
    out = idle_run(ListingClient(ServiceUnavailable("http://fake", "ConnectError")))
    assert "cannot take" not in out and "exiting after 0 trial(s)" in out
    out = idle_run(ListingClient([study("mine"), study("done", H100, state="finished")]))
    assert "cannot take" not in out and "mine" not in out and "done" not in out


# --- the reasons ---------------------------------------------------------------------------------


def test_the_reasons_name_the_fix() -> None:
    studies = [study("cpu-study"), study("h100-study", H100), study("plugin", H100, workload="mywl"),
               study("two-gpus", H100, gpus_per_trial=2), study("takeable", H100),
               study("stopped", "cpu", state="stopped"), "not a study"]
    skipped = {s.name: s for s in skipped_studies(studies, H100, ("gpt", "ups"), 1)}
    assert set(skipped) == {"cpu-study", "plugin", "two-gpus"}
    assert skipped["cpu-study"].hardware == "cpu"
    reason = skipped["cpu-study"].reason  # the case: a spec without hardware, a GPU worker
    assert "a CPU study" in reason and "--device cpu" in reason and f"hardware: {H100}" in reason
    assert "--allow-workload mywl" in skipped["plugin"].reason
    assert "--gpus-per-trial 2" in skipped["two-gpus"].reason

    other_gpu = skipped_studies(studies, "NVIDIA A100-SXM4-80GB", ("gpt", "ups"), 1)
    assert {s.name for s in other_gpu} == {"cpu-study", "h100-study", "plugin", "two-gpus", "takeable"}
    assert "this worker's GPU is 'NVIDIA A100-SXM4-80GB'" in other_gpu[1].reason

    pinned = skipped_studies(studies, "cpu", ("gpt", "ups"), 1, study="h100-study")
    assert [s.name for s in pinned] == ["h100-study"] and "--device cuda" in pinned[0].reason
