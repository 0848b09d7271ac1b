"""Fakes for the worker's tests: the CPU host a test worker reports, a scripted service client,
a lease and a fake probe child program (a script written to the test's tmp_path)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

from autotune.contract.protocol import ProbeSpec
from autotune.contract.results import HeartbeatReply, ReportReply, TrialLease
from autotune.contract.views import TrialInfo, TrialList
from autotune.worker.hardware import Hardware

HARDWARE = Hardware(hardware_class="cpu", device="cpu", device_name="cpu (test)", memory_bytes=None,
                    torch_version=torch.__version__, hostname="testhost", cpu_count=2)


class FakeClient:
    """Records every call; replies as scripted."""

    base_url = "http://fake"

    def __init__(self, prune_at: int | None = None, heartbeat: str = "continue", report_error: Exception | None = None,
                 complete_error: Exception | None = None, leases: list[TrialLease | None] | None = None) -> None:
        self.prune_at = prune_at
        self.heartbeat_action = heartbeat
        self.report_error = report_error
        self.complete_error = complete_error
        self.leases = list(leases or [])
        self.calls: list[tuple[str, Any]] = []
        self.completed: list[dict[str, Any]] = []
        self.handed: list[TrialLease] = []

    def lease(self, request: Any, **kw: Any) -> TrialLease | None:
        self.calls.append(("lease", request))
        lease = self.leases.pop(0) if self.leases else None
        if lease is not None:
            self.handed.append(lease)
        return lease

    def health(self, **kw: Any) -> dict[str, Any]:
        """The service's identity, which the worker asks after each lease and before a delivery."""
        return {"status": "ok", "db": "sqlite", "version": "test", "service_id": "fake-service"}

    def trials(self, name: str, **kw: Any) -> TrialList:
        """The trials of study `name` this service leased (a spooled result is delivered only into its study)."""
        data = [TrialInfo(trial_id=t.trial_id, number=t.number, state="RUNNING", params=t.params)
                for t in self.handed if t.study == name]
        return TrialList(data=data, count=len(data))

    def heartbeat(self, trial_id: int, worker_id: str, **kw: Any) -> HeartbeatReply:
        self.calls.append(("heartbeat", trial_id))
        return HeartbeatReply(action=self.heartbeat_action, reason="study 'x' was stopped")  # type: ignore[arg-type]

    def report(self, trial_id: int, worker_id: str, step: int, metrics: dict[str, float], **kw: Any) -> ReportReply:
        self.calls.append(("report", step))
        if self.report_error is not None:
            raise self.report_error
        return ReportReply(prune=self.prune_at is not None and step >= self.prune_at, reason="test prune")

    def complete(self, trial_id: int, worker_id: str, result: dict[str, Any], **kw: Any) -> TrialInfo:
        self.calls.append(("complete", trial_id))
        if self.complete_error is not None:
            raise self.complete_error
        self.completed.append(result)
        state = "FAIL" if result.get("failure") else "PRUNED" if result.get("stopped_early") else "COMPLETE"
        return TrialInfo(trial_id=trial_id, number=0, state=state, params={})

    def close(self) -> None:
        pass


def make_lease(timeout_s: float = 60.0, trial_id: int = 7) -> TrialLease:
    return TrialLease(trial_id=trial_id, study="s", number=0, params={"batch_size": 4}, config={"batch_size": 4},
                      workload="ups", preset="tiny", probe=ProbeSpec(samples=40, timeout_s=timeout_s))


def fake_child(tmp_path: Path, code: str) -> list[str]:
    script = tmp_path / "fake_child.py"
    script.write_text(textwrap.dedent(code))
    return [sys.executable, str(script)]
