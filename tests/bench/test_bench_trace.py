"""bench/trace_summary.py on a trace shaped like a CUDA probe's: torch.profiler writes each named
range twice there (host and GPU stream), and the GPU runs the last step's kernels after the
host has moved on. (A CPU probe's real trace is read in tests/cli/test_cli.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import trace_summary


def _x(name: str, cat: str, ts: float, dur: float) -> dict[str, object]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_a_cuda_trace_counts_host_steps_once_and_the_kernels_that_run_after_them(tmp_path: Path) -> None:
    events = []
    for i in range(2):  # two steps of 1000 us on the host, 100 us of data wait before each
        t = i * 1100.0
        events += [_x("autotune.data", "user_annotation", t, 100),
                   _x("autotune.step", "user_annotation", t + 100, 1000),
                   _x("autotune.data", "gpu_user_annotation", t + 300, 10),
                   _x("autotune.step", "gpu_user_annotation", t + 400, 1500),
                   _x("cudaGraphLaunch", "cuda_runtime", t + 200, 300),
                   _x("Optimizer.step#AdamW.step", "user_annotation", t + 600, 400),
                   _x("torch::autograd::AccumulateGrad", "cpu_op", t + 150, 5),
                   _x("torch::autograd::AccumulateGrad", "cpu_op", t + 160, 5),
                   _x("kernel_a", "kernel", t + 500, 400)]
    events.append(_x("kernel_late", "kernel", 2200, 200))  # the last step's work, after the host's last step
    trace = tmp_path / "cuda.json"
    trace.write_text(json.dumps({"traceEvents": events}))

    row = trace_summary.summarize(trace)

    assert row["steps"] == 2  # not 4: the GPU-side copies are not steps
    assert row["step_host_ms"] == pytest.approx(1.0) and row["data_wait_ms"] == pytest.approx(0.1)
    assert row["kernels_per_step"] == 1.5  # the late kernel counts
    assert row["span_ms"] == pytest.approx(2.4)  # 0 .. 2400 us: the late kernel's end
    assert row["gpu_busy_fraction"] == pytest.approx(1000 / 2400)
    assert row["runtime_per_step"]["cudaGraphLaunch"] == {"calls": 1.0, "ms": 0.3}
    ops = row["host_ops_per_step"]
    assert next(iter(ops)) == "Optimizer.step#AdamW.step"  # the heaviest first
    assert ops["torch::autograd::AccumulateGrad"] == {"calls": 2.0, "ms": 0.01}
    assert "autotune.step" not in ops and "autotune.data" not in ops
