"""`autotune spool list|clear`: the worker's spool on disk, without a service (deliver, which
needs one, is in tests/api/test_spool_deliver.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner, Result

from autotune.cli.main import app
from autotune.worker.spool import Spool, SpoolEntry

A, B = "0f6c2e9e-1111-4a4a-8888-aaaaaaaaaaaa", "7d1b3c5f-2222-4b4b-9999-bbbbbbbbbbbb"
RESULT = {"workload": "ups", "preset": "tiny", "config": {"batch_size": 4}, "throughput_samples_per_s": 123.5,
          "failure": None}


def invoke(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(app, ["spool", *args], input=input, env={"COLUMNS": "250"})


def entry(service_id: str | None, trial_id: int, api: str = "http://a:8000", **result: Any) -> SpoolEntry:
    return SpoolEntry(api=api, trial_id=trial_id, worker_id=f"host-{trial_id}", study="rel", number=trial_id - 1,
                      result={**RESULT, **result}, service_id=service_id, lease_token="t" * 32)


def filled(root: Path) -> Spool:
    """A's pending trial 1, A's settled leftover trial 2, A's rejected trial 3, B's pending trial 4
    (another URL) and a pending trial 5 of an unknown service."""
    spool = Spool(root)
    for e in (entry(A, 1), entry(A, 2, throughput_samples_per_s=99.0), entry(A, 3), entry(B, 4, api="http://b:9000"),
              entry(None, 5, failure={"kind": "oom", "message": "out of memory"}, throughput_samples_per_s=None)):
        spool.put(e)
    spool.settle(entry(A, 2))
    (refused,) = [e for e in spool.pending() if e.trial_id == 3]
    spool.reject(refused, "HTTP 422: result.config: not the leased config")
    return spool


def left(spool: Spool) -> dict[int, str]:
    return {row.entry.trial_id: row.state for row in spool.inventory()}


def test_list_shows_one_row_per_result_with_where_it_belongs_and_its_state(tmp_path: Path) -> None:
    spool = filled(tmp_path / "spool")
    (tmp_path / "spool" / "trial-9-broken.json").write_text("{not json")
    result = invoke("list", "--spool-dir", str(spool.root))
    assert result.exit_code == 0, result.output
    rows = {int(line.split("(id ")[1].split(")")[0]): line for line in result.stdout.splitlines() if "(id " in line}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert A in rows[1] and "rel" in rows[1] and "0 (id 1)" in rows[1] and "host-1" in rows[1]
    assert "123.5 samples/s" in rows[1] and rows[1].rstrip(" │").endswith("pending")
    assert "99.0 samples/s" in rows[2] and "settled" in rows[2]
    assert "rejected" in rows[3] and "HTTP 422: result.config: not the leased config" in rows[3]
    assert B in rows[4] and "failed (oom)" in rows[5] and "unknown id" in rows[5]
    assert "http://a:8000" in result.stdout and "http://b:9000" in result.stdout  # each service's URL
    assert "5 result(s): 3 pending, 1 settled, 1 rejected" in result.stdout
    assert "trial-9-broken.json: not a spooled result" in result.stderr  # said, and left alone
    assert (tmp_path / "spool" / "trial-9-broken.json").exists()


def test_list_as_json_and_of_an_empty_spool(tmp_path: Path) -> None:
    spool = filled(tmp_path / "spool")
    result = invoke("list", "--spool-dir", str(spool.root), "--json")
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["trial_id"], r["state"]) for r in rows] == [(1, "pending"), (2, "settled"), (4, "pending"),
                                                           (5, "pending"), (3, "rejected")]
    assert rows[0]["service_id"] == A and rows[0]["throughput_samples_per_s"] == 123.5
    assert rows[0]["belongs_to"] == f"service {A} at http://a:8000, study 'rel', trial 0 (id 1)"
    assert rows[4]["reason"].startswith("HTTP 422") and Path(rows[4]["path"]).parent.name == "rejected"
    empty = invoke("list", "--spool-dir", str(tmp_path / "nothing-here"))
    assert empty.exit_code == 0 and "no results in the spool" in empty.stdout
    assert "(no such folder: is it the worker's --spool-dir?)" in empty.stdout  # a mistyped path says so
    (tmp_path / "empty").mkdir()
    empty = invoke("list", "--spool-dir", str(tmp_path / "empty"))
    assert empty.exit_code == 0 and "no results in the spool" in empty.stdout and "no such folder" not in empty.stdout


def test_clear_without_a_choice_deletes_only_what_the_service_has_already(tmp_path: Path) -> None:
    spool = filled(tmp_path / "spool")
    result = invoke("clear", "--spool-dir", str(spool.root), "--yes")
    assert result.exit_code == 0, result.output
    assert left(spool) == {1: "pending", 3: "rejected", 4: "pending", 5: "pending"}  # nothing measured is lost
    assert "deleted settled trial 1 of rel (id 2)" in result.stdout
    assert "deleted 1 result(s) (1 settled)" in result.stdout
    assert "kept 4 result(s) (3 pending, 1 rejected): --service ID or --all deletes pending" in result.stderr


def test_clear_service_asks_first_and_deletes_only_that_services_results(tmp_path: Path) -> None:
    spool = filled(tmp_path / "spool")
    no = invoke("clear", "--spool-dir", str(spool.root), "--service", A[:8], input="n\n")
    assert no.exit_code == 1 and "Delete these 3 result(s) (1 pending, 1 settled, 1 rejected)" in no.stdout
    assert len(left(spool)) == 5  # answered no: nothing deleted
    yes = invoke("clear", "--spool-dir", str(spool.root), "--service", A[:8], input="y\n")
    assert yes.exit_code == 0, yes.output
    assert left(spool) == {4: "pending", 5: "pending"}
    assert "deleted pending trial 0 of rel (id 1) of service " + A in yes.stdout
    assert "deleted 3 result(s) (1 pending, 1 settled, 1 rejected) and 1 settled note(s)" in yes.stdout
    assert not (spool.root / A).exists()  # its folder went with them


def test_clear_rejected_keeps_every_pending_result(tmp_path: Path) -> None:
    spool = filled(tmp_path / "spool")
    result = invoke("clear", "--spool-dir", str(spool.root), "--rejected", "--yes")
    assert result.exit_code == 0, result.output
    assert left(spool) == {1: "pending", 2: "settled", 4: "pending", 5: "pending"}
    assert "deleted rejected trial 2 of rel (id 3)" in result.stdout


def test_clear_all_deletes_everything_and_by_url_the_unknown_services(tmp_path: Path) -> None:
    spool = filled(tmp_path / "spool")
    by_url = invoke("clear", "--spool-dir", str(spool.root), "--service", "http://b:9000", "--yes")
    assert by_url.exit_code == 0 and set(left(spool)) == {1, 2, 3, 5}
    everything = invoke("clear", "--spool-dir", str(spool.root), "--all", "--yes")
    assert everything.exit_code == 0 and left(spool) == {}
    assert "deleted 4 result(s)" in everything.stdout and list(spool.root.iterdir()) == []


def test_clear_refuses_what_it_cannot_tell(tmp_path: Path) -> None:
    spool = filled(tmp_path / "spool")
    unknown = invoke("clear", "--spool-dir", str(spool.root), "--service", "feedface", "--yes")
    assert unknown.exit_code == 2 and "no results of that service" in unknown.stderr and A in unknown.stderr
    spool.put(entry(A.replace("aaaa", "cccc"), 6))  # two ids that start alike
    ambiguous = invoke("clear", "--spool-dir", str(spool.root), "--service", "0f6c", "--yes")
    assert ambiguous.exit_code == 2 and "more than one service id" in ambiguous.stderr
    both = invoke("clear", "--spool-dir", str(spool.root), "--service", A, "--all", "--yes")
    assert both.exit_code == 2 and len(left(spool)) == 6
