"""``pytest --cpu-by-module PATH``: where the suite's CPU goes, module by module.

Per test, the CPU seconds of the test process (getrusage SELF) and of the subprocesses it reaped
(getrusage CHILDREN: services, workers, probe children, scripts) between its start and its end,
summed by module with the wall seconds and the test count, and the heaviest tests one by one.
Under pytest-xdist each test process writes PATH.<worker>.json and the controlling process merges
them into PATH at the end, sorted by CPU. Not counted: collection, processes a test leaves to
others to reap, and servers outside the suite (PostgreSQL). bench/results/suite_time.json holds
a run's (`cpu_by_module`).
"""

from __future__ import annotations

import glob
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import pytest

TOP_TESTS = 100  # the heaviest tests listed one by one
_by_test: dict[str, list[float]] = {}  # nodeid -> [self CPU-s, children CPU-s, wall s]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-by-module", metavar="PATH", default=None,
                     help="write the CPU seconds of each test module (its processes and the subprocesses it "
                          "reaped) to PATH (JSON)")


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Around a test's setup, call and teardown, in the process that runs it (not xdist's controller)."""
    own0, children0 = _cpu()
    wall0 = time.monotonic()
    yield
    own1, children1 = _cpu()
    _by_test[item.nodeid] = [own1 - own0, children1 - children0, time.monotonic() - wall0]


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--cpu-by-module")
    if not path:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # one file per test process; the controller merges them
        Path(f"{path}.{worker}.json").write_text(json.dumps(_by_test))
        return
    tests = dict(_by_test)
    for part in glob.glob(f"{glob.escape(path)}.gw*.json"):
        tests.update(json.loads(Path(part).read_text()))
        os.remove(part)
    by_module: dict[str, list[float]] = {}  # module -> [self CPU-s, children CPU-s, wall s, tests]
    for nodeid, (own, children, wall) in tests.items():
        row = by_module.setdefault(nodeid.split("::")[0], [0.0, 0.0, 0.0, 0])
        row[0] += own
        row[1] += children
        row[2] += wall
        row[3] += 1
    rows = [{"module": m, "cpu_s": round(r[0] + r[1], 2), "self_cpu_s": round(r[0], 2),
             "children_cpu_s": round(r[1], 2), "wall_s": round(r[2], 2), "tests": int(r[3])}
            for m, r in sorted(by_module.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))]
    heaviest = [{"test": t, "cpu_s": round(r[0] + r[1], 2), "self_cpu_s": round(r[0], 2),
                 "children_cpu_s": round(r[1], 2), "wall_s": round(r[2], 2)}
                for t, r in sorted(tests.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:TOP_TESTS]]
    totals = {f"{k}_cpu_s": round(sum(r[f"{k}_cpu_s"] for r in rows), 1) for k in ("self", "children")}
    Path(path).write_text(json.dumps({"total_cpu_s": round(sum(r["cpu_s"] for r in rows), 1), **totals,
                                      "modules": rows, "heaviest_tests": heaviest}, indent=1))
