"""The layout of bench/results/: summaries committed as JSON, raw data gzipped beside them or dropped.

A benchmark writes its JSON whole (every probe's windows, every trial's row, its logs). What is
committed is split by the rules below (`RULES`, by file name):

    X.json              the summary: the document without its raw fields, with a "_layout" entry
                        that names where they went
    X.raw.json.gz       the raw fields, in X.json's own shape: `load` puts them back, so a reader
                        gets the document as the benchmark wrote it
    dropped fields      (a rule's `drop`) records of a CPU run of minutes, not kept: the command in
                        "_layout" writes them again; `load` gives the document without them
    D.tar.gz            a folder of raw runs (each study's database, state.json and logs), packed;
                        `unpacked(D)` reads it (a folder D that is not there is read from D.tar.gz)

    python bench/resultfiles.py split bench/results/X.json ...   # after a benchmark (re)wrote X.json
    python bench/resultfiles.py join bench/results/X.json > /tmp/X.json   # the whole document
    python bench/resultfiles.py pack bench/results/D      # the folder D into D.tar.gz (D removed)
    python bench/resultfiles.py size                      # bench/results/ against its limit

A file no rule names is committed as written. A summary rewritten whole by its benchmark (no
"_layout" entry) is read as it is, its old raw file ignored until it is split again.
tests/bench/test_bench_results.py holds bench/results/ to `LIMIT_BYTES` and checks that every
results file the READMEs cite exists.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import gzip
import io
import json
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LIMIT_BYTES = 3 * 2**20  # bench/results/, every file in it counted
RAW_SUFFIX = ".raw.json.gz"
LAYOUT = "_layout"  # a split summary's entry: where its raw fields are, or which were dropped and how to get them

# a probe's per-window and per-step readings, the knobs it resolved, its setup's phases and its notes
# (autotune probe --json): the summary keeps its throughput, spread, NRMSE, timings and failure
PROBE_RAW = frozenset({
    "window_throughputs", "raw_window_throughputs", "window_data_wait_s", "window_gpu", "window_host",
    "window_steps", "window_energy_j_per_sample", "window_loop_busy_fraction", "epoch_boundaries", "loss_curve",
    "setup_phases", "compile_workers", "knobs", "measurement_notes"})
# what a harness around the service logged: per-trial rows, log tails, the texts the CLI printed
LOGS_RAW = frozenset({"trials", "status_text", "study_info", "worker_log_tail", "service_log_tail", "best_yaml",
                      "stdout_tail", "per_iteration_ms"})


@dataclass(frozen=True)
class Rule:
    """A results file's summary: the document without the fields named in `raw` and `drop` (by key, at
    any depth). The `raw` ones go to X.raw.json.gz; the `drop` ones are left out, and the command
    `regenerate` writes them again. `indent`: the summary's JSON indentation (None: compact, for a
    summary that is mostly rows of numbers, read by the scripts rather than by eye)."""

    raw: frozenset[str] = frozenset()
    drop: frozenset[str] = frozenset()
    regenerate: str | None = None
    indent: int | None = 1

    def __post_init__(self) -> None:
        if self.drop and not self.regenerate:
            raise ValueError("a rule that drops fields names the command that regenerates them")


VERDICT_CMD = ("python bench/verdict.py --seeds 40 --scenarios aa,win2,win15,win2-long,loss,loss-tol --parallel 2 "
               "--out bench/results/verdict.json")
RULES: dict[str, Rule] = {
    # a short probe and its long run per config, in rounds (tuning.py fidelity): the configs' knobs (each
    # names its study's trial) and the priming probes go with the windows
    "fidelity_h100*.json": Rule(PROBE_RAW | {"config", "prime"}, indent=None),
    # probe documents: fixed configs (probe_configs.py), the pick in a loop (optimizer_step.py), compile-cache
    # states and repeats (tuning.py cache-states, host_bound.sh), DDP ("rows" is its table, "results" each
    # case's probe), energy, the CPU demo's runs, the outside script's verdict
    "probe_full_h100*.json": Rule(PROBE_RAW, indent=None),
    "probe_followup_h100*.json": Rule(PROBE_RAW, indent=None),
    "optimizer_step_*.json": Rule(PROBE_RAW, indent=None),
    "cache_states_h100.json": Rule(PROBE_RAW, indent=None),
    "host_bound_h100.jsonl": Rule(PROBE_RAW),
    "ddp_h200*.json": Rule(PROBE_RAW | {"results"}),
    "ddp_launcher_ab_h200x2.json": Rule(PROBE_RAW | {"results"}),
    "energy_h100.json": Rule(PROBE_RAW | {"trials", "best_yaml", "study", "pareto"}, indent=None),
    "cpu_demo_win.json": Rule(PROBE_RAW | {"runs"}),
    "gpt_script_verdict_h200*.json": Rule(PROBE_RAW | LOGS_RAW, indent=None),
    "hf_causal_lm_verdict_h200*.json": Rule(PROBE_RAW | LOGS_RAW, indent=None),
    "hf_causal_lm_lm_knobs_h200*.json": Rule(PROBE_RAW | LOGS_RAW, indent=None),
    # probe_loop_gap.py: each window's reading and each window pair's ratio (the summary keeps the intervals)
    "probe_loop_gap_char*.json": Rule(frozenset({"window_samples_per_s", "window_throughputs", "window_ratios"})),
    "probe_loop_gap_gpt*.json": Rule(frozenset({"window_samples_per_s", "window_throughputs", "window_ratios"})),
    # lm_space_study.py: each study's trials, anytime curve and tune log (the summary keeps the verdict)
    "lm_space_study_h100.json": Rule(frozenset({"trials", "anytime", "tune", "provenance"})),
    "lm_batch*_graph_study_h[12]00.json": Rule(frozenset({"trials", "anytime", "tune", "provenance"}), indent=None),
    # warm_start_gpu.py: every trial of the three studies (the summary keeps each study's verdict and curve)
    "warm_start_h200.json": Rule(frozenset({"trials"}), indent=None),
    # lm_knobs.py: each run's probe document (the table is built from "summary")
    "lm_knobs_*.json": Rule(frozenset({"runs"}), indent=None),
    # tuning.py analyze: each strategy's trial rows and the fidelity pairs (its command writes them again
    # from the studies' archives and the fidelity files, in a minute; kept all the same)
    "tuning_h100*.json": Rule(frozenset({"rows", "fidelity"})),
    "chaos_elsewhere.json": Rule(frozenset({"trial_list", "spool_seen"}), indent=None),
    "service_load_paced*.json": Rule(frozenset({"trials", "lease_ms_by_trial_number", "by_quarter_mean_ms"})),
    # CPU runs of minutes: their per-study and per-trial records are dropped (the summaries, and each
    # study's outcome in X.raw.json.gz, are kept)
    "verdict.json": Rule(frozenset({"studies"}), drop=frozenset({
        "recommendation", "configs", "truth", "trials", "message", "workers_ended", "error_examples",
        "mismatched_trials"}), regenerate=VERDICT_CMD),
    "verdict_aa_2gpu.json": Rule(frozenset({"studies"}), drop=frozenset({
        "recommendation", "configs", "truth", "message", "workers_ended", "error_examples", "mismatched_trials"}),
        regenerate="python bench/verdict.py --seeds 100 --scenarios aa-2gpu --parallel 2 "
                   "--out bench/results/verdict_aa_2gpu.json"),
    "verdict_two_workers.json": Rule(frozenset({"studies"}), drop=frozenset({
        "recommendation", "configs", "truth", "message", "workers_ended", "error_examples", "mismatched_trials"}),
        regenerate="python bench/verdict.py --seeds 40 --scenarios win15,win2,aa --workers 2 --parallel 2 "
                   "--out bench/results/verdict_two_workers.json"),
    "verdict_headroom.json": Rule(frozenset({"studies"}), drop=frozenset({
        "recommendation", "configs", "truth", "message", "workers_ended", "error_examples", "mismatched_trials"}),
        regenerate="python bench/verdict.py --seeds 40 --scenarios aa-tol0,loss,win15 --parallel 2 "
                   "--out bench/results/verdict_headroom.json"),
    "verdict_headroom_default.json": Rule(frozenset({"studies"}), drop=frozenset({
        "recommendation", "configs", "truth", "message", "workers_ended", "error_examples", "mismatched_trials"}),
        regenerate="python bench/verdict.py --seeds 40 --scenarios aa,win2,win15,win2-long,loss,loss-tol "
                   "--parallel 2 --out bench/results/verdict_headroom_default.json"),
    "service_load.json": Rule(frozenset({"lease_ms_by_trial_number"}), drop=frozenset({"trials"}),
                              regenerate="python bench/service_load.py"),
    "service_load_profile.json": Rule(frozenset({"lease_ms_by_trial_number", "by_quarter_mean_ms"}),
                                      drop=frozenset({"trials"}),
                                      regenerate=("python bench/service_load.py --server instrumented "
                                                  "--out bench/results/service_load_profile.json")),
}


def rule_for(path: Path) -> Rule | None:
    return next((rule for pattern, rule in RULES.items() if fnmatch.fnmatch(path.name, pattern)), None)


def raw_path(path: Path) -> Path:
    """X.json's (or X.jsonl's) raw file, X.raw.json.gz."""
    return path.with_name(path.name.removesuffix(".jsonl").removesuffix(".json") + RAW_SUFFIX)


# --- split and merge ---------------------------------------------------------------------------------


def split(doc: Any, keys: frozenset[str]) -> tuple[Any, Any]:
    """(summary, raw): `doc` without the fields named in `keys` (at any depth), and those fields in
    `doc`'s shape (a dict holds a field taken out, or the raw part of a kept one; a list the raw part
    of each item, None where an item has none); raw is None when nothing was taken out.
    merge(*split(doc, keys)) == doc."""
    if isinstance(doc, dict):
        summary, raw = {}, {}
        for key, value in doc.items():
            if key in keys:
                raw[key] = value
                continue
            summary[key], part = split(value, keys)
            if part is not None:
                raw[key] = part
        return summary, (raw or None)
    if isinstance(doc, list):
        pairs = [split(item, keys) for item in doc]
        parts = [part for _, part in pairs]
        return [s for s, _ in pairs], (parts if any(p is not None for p in parts) else None)
    return doc, None


def merge(summary: Any, raw: Any) -> Any:
    """The document `split` took apart: `raw`'s fields put back into `summary`."""
    if raw is None:
        return summary
    if isinstance(summary, dict) and isinstance(raw, dict):
        out = dict(summary)
        for key, part in raw.items():
            out[key] = merge(out[key], part) if key in out else part
        return out
    if isinstance(summary, list) and isinstance(raw, list) and len(summary) == len(raw):
        return [merge(s, r) for s, r in zip(summary, raw, strict=True)]
    raise ValueError(f"raw data that does not fit its summary ({type(summary).__name__} against "
                     f"{type(raw).__name__})")


# --- reading -----------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    if path.name.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


def _parse(text: str, path: Path) -> Any:
    if path.name.removesuffix(".gz").endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def load(path: str | Path) -> Any:
    """A results document as its benchmark wrote it: X.json with the raw fields of X.raw.json.gz put
    back (less the fields a rule dropped), X.json.gz, or a JSONL file (a list of its lines'
    documents). A path that is not there is read from its gzipped name (X.json from X.json.gz)."""
    path = Path(path)
    if not path.exists() and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")
    doc = _parse(_read_text(path), path)
    layout = doc.pop(LAYOUT, None) if isinstance(doc, dict) else None
    raw = raw_path(path)
    # a split summary names its raw file; a JSONL file's lines have no place for the name
    if raw.exists() and (isinstance(doc, list) or (layout or {}).get("raw") == raw.name):
        doc = merge(doc, json.loads(_read_text(raw)))
    return doc


@contextlib.contextmanager
def unpacked(path: str | Path) -> Iterator[Path]:
    """A folder of raw runs to read: `path` itself where it is a folder, else its archive (`path` naming
    D.tar.gz, or D.tar.gz beside a folder D that is not there) extracted into a temporary folder."""
    path = Path(path)
    archive = path if path.name.endswith(".tar.gz") else path.with_name(path.name + ".tar.gz")
    if path.is_dir() or not archive.exists():
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="autotune-results-") as tmp:
        with tarfile.open(archive, "r:gz") as tar:
            if hasattr(tarfile, "data_filter"):  # Python 3.10.12+, 3.11.4+: no links out, no absolute paths
                tar.extractall(tmp, filter="data")
            else:
                tar.extractall(tmp)  # our own archives
        yield Path(tmp) / archive.name.removesuffix(".tar.gz")


# --- writing -----------------------------------------------------------------------------------------


def _gzip(data: bytes) -> bytes:
    """gzip at level 9 with no name or time in its header: the same bytes for the same data."""
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=9, mtime=0) as f:
        f.write(data)
    return out.getvalue()


def split_file(path: Path, rule: Rule | None = None) -> tuple[int, int]:
    """Split the results file `path` (as its benchmark wrote it, or split before) by its rule, in place:
    (summary bytes, raw bytes written)."""
    rule = rule or rule_for(path)
    if rule is None:
        raise SystemExit(f"{path.name}: no rule in bench/resultfiles.py RULES names it")
    kept, _ = split(load(path), rule.drop)
    summary, raw = split(kept, rule.raw)
    raw_file = raw_path(path)
    layout: dict[str, Any] = {}
    if raw is not None:  # the fields moved are the rule's (RULES)
        layout["raw"] = raw_file.name
    if rule.drop:
        layout |= {"dropped": sorted(rule.drop), "regenerate": rule.regenerate}
    if path.suffix == ".jsonl":  # one document a line, as written
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in summary)
    else:
        if layout:
            summary = {LAYOUT: layout, **summary}
        text = json.dumps(summary, indent=rule.indent, ensure_ascii=False,
                          separators=None if rule.indent is not None else (",", ":")) + "\n"
    path.write_text(text, encoding="utf-8")
    if raw is None:
        raw_file.unlink(missing_ok=True)
        return len(text.encode()), 0
    data = _gzip(json.dumps(raw, separators=(",", ":"), ensure_ascii=False).encode())
    raw_file.write_bytes(data)
    return len(text.encode()), len(data)


def pack(folder: Path) -> Path:
    """The folder `folder` into `folder`.tar.gz (sorted, no owners, no times: the same bytes for the same
    files), and the folder removed."""
    archive = folder.with_name(folder.name + ".tar.gz")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted([folder, *folder.rglob("*")]):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(folder.parent)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            if path.is_file():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    archive.write_bytes(_gzip(buffer.getvalue()))
    shutil.rmtree(folder)
    return archive


def results_size(root: Path = RESULTS) -> int:
    """The bytes of every file under `root`."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    s = sub.add_parser("split", help="split results files by their rules, in place")
    s.add_argument("paths", nargs="+", type=Path)
    j = sub.add_parser("join", help="print a results document whole (summary and raw fields)")
    j.add_argument("path", type=Path)
    p = sub.add_parser("pack", help="a folder of raw runs into FOLDER.tar.gz (the folder removed)")
    p.add_argument("folders", nargs="+", type=Path)
    sub.add_parser("size", help="bench/results/'s size against its limit")
    args = parser.parse_args(argv)
    if args.step == "split":
        for path in args.paths:
            rule = rule_for(path)
            summary, raw = split_file(path, rule)
            kept = f" + {raw_path(path).name} {raw} B" if raw else ""
            dropped = f"; dropped {', '.join(sorted(rule.drop))}" if rule and rule.drop else ""
            print(f"{path}: {summary} B{kept}{dropped}")
    elif args.step == "join":
        json.dump(load(args.path), sys.stdout, indent=1, ensure_ascii=False)
        print()
    elif args.step == "pack":
        for folder in args.folders:
            print(f"{folder} -> {pack(folder)}")
    else:
        size = results_size()
        print(f"{RESULTS}: {size} B of {LIMIT_BYTES} ({size / LIMIT_BYTES:.0%})")
        return 0 if size <= LIMIT_BYTES else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
