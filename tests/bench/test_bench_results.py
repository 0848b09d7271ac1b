"""bench/results/ stays small and whole: at most 3 MiB, summaries committed and raw data gzipped
beside them or dropped with the command that writes it again (bench/resultfiles.py); every
results file that README.md and bench/README.md cite is there, and every split file reads back
whole."""

from __future__ import annotations

import glob
import gzip
import json
import re
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import resultfiles  # a bench module (bench/ is not a package)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
LIMIT = 3 * 2**20

# names in backticks that the READMEs give for files inside a run's folder, not in bench/results/
NOT_RESULTS = {"state.json"}


def test_bench_results_is_at_most_3_mib() -> None:
    files = sorted((p for p in RESULTS.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)
    total = sum(p.stat().st_size for p in files)
    largest = ", ".join(f"{p.relative_to(RESULTS)} {p.stat().st_size // 1024} KiB" for p in files[:8])
    assert resultfiles.LIMIT_BYTES == LIMIT
    assert total <= LIMIT, (f"bench/results/ holds {total} B, over {LIMIT} (3 MiB): split the new files "
                            f"(python bench/resultfiles.py split ...; bench/README.md, 'Results'). "
                            f"Largest: {largest}")


def _cited(doc: str) -> list[str]:
    """The results files `doc` names: `results/PATH` (a file, a glob, {a,b} alternatives or a folder)
    anywhere, and bare file names in backticks (`tuning_h100.json`), fragments (`_23.json`) left out."""
    text = (ROOT / doc).read_text()
    paths = re.findall(r"results/([\w*{][\w.*{},/<>-]*[\w*}/])", text)  # not a placeholder: results/<name>.json
    bare = [name for name in re.findall(r"`([\w*{},-]+\.(?:json|jsonl|png|gz))`", text)
            if not name.startswith(("_", ".")) and name not in NOT_RESULTS]
    return paths + bare


def _exists(path: str) -> bool:
    path = path.split("/<")[0].rstrip("/")  # results/tuning_h100/<strategy>/: the folder
    braces = re.match(r"(.*)\{(.*?)\}(.*)", path)  # results/pruning_h200_study{1,2}.json
    expanded = [f"{braces.group(1)}{part}{braces.group(3)}" for part in braces.group(2).split(",")] \
        if braces else [path]
    # a folder of raw runs is committed as its archive (resultfiles.unpacked reads either)
    return all(glob.glob(str(RESULTS / p)) or (RESULTS / f"{p}.tar.gz").is_file() for p in expanded)


@pytest.mark.parametrize("doc", ["README.md", "bench/README.md"])
def test_every_results_file_the_readmes_cite_exists(doc: str) -> None:
    cited = _cited(doc)
    assert cited, f"{doc} cites no results file"
    missing = sorted({path for path in cited if not _exists(path)})
    assert not missing, f"{doc} cites results files that bench/results/ does not hold: {missing}"


def test_every_split_file_reads_back_whole() -> None:
    """Each X.raw.json.gz has its summary, which names it, and the two merge; each summary of a rule
    that drops fields says which and the command that writes them again."""
    raws = sorted(RESULTS.glob(f"*{resultfiles.RAW_SUFFIX}"))
    assert raws
    for raw in raws:
        stem = raw.name.removesuffix(resultfiles.RAW_SUFFIX)
        summaries = [p for p in (RESULTS / f"{stem}.json", RESULTS / f"{stem}.jsonl") if p.is_file()]
        assert len(summaries) == 1, f"{raw.name} has no summary beside it"
        summary = summaries[0]
        if summary.suffix == ".json":
            layout = json.loads(summary.read_text()).get(resultfiles.LAYOUT) or {}
            assert layout.get("raw") == raw.name, f"{summary.name} does not name {raw.name}"
        with gzip.open(raw, "rt") as f:
            assert json.load(f) is not None
        doc = resultfiles.load(summary)  # raises where the raw part does not fit its summary
        assert resultfiles.LAYOUT not in (doc if isinstance(doc, dict) else {})
    for pattern, rule in resultfiles.RULES.items():
        for path in RESULTS.glob(pattern):
            if rule.drop and path.suffix == ".json":
                layout = json.loads(path.read_text())[resultfiles.LAYOUT]
                assert layout["dropped"] == sorted(rule.drop) and layout["regenerate"] == rule.regenerate
    for archive in RESULTS.glob("*.tar.gz"):
        with tarfile.open(archive, "r:gz") as tar:
            assert any(m.name.endswith("study.db") for m in tar.getmembers()), archive.name


def test_split_and_merge_give_the_document_back(tmp_path: Path) -> None:
    doc = {"environment": {"gpu": "H100"}, "configs": [
        {"number": 3, "short": {"throughput_samples_per_s": 5.0, "window_throughputs": [4.0, 6.0]}},
        {"number": 4, "short": {"throughput_samples_per_s": 7.0}},
    ], "trials": [{"n": 1}]}
    summary, raw = resultfiles.split(doc, resultfiles.PROBE_RAW)
    assert summary["configs"][0]["short"] == {"throughput_samples_per_s": 5.0}
    assert raw == {"configs": [{"short": {"window_throughputs": [4.0, 6.0]}}, None]}
    assert resultfiles.merge(summary, raw) == doc
    path = tmp_path / "fidelity_h100_x.json"
    path.write_text(json.dumps(doc))
    resultfiles.split_file(path)
    written = json.loads(path.read_text())
    assert written["configs"][0]["short"] == {"throughput_samples_per_s": 5.0} and "trials" in written
    assert written[resultfiles.LAYOUT] == {"raw": "fidelity_h100_x.raw.json.gz"}
    assert resultfiles.raw_path(path).is_file()
    assert resultfiles.load(path) == doc
    path.write_text(json.dumps(doc | {"note": "rewritten whole"}))  # by its benchmark: the old raw file is stale
    assert resultfiles.load(path) == doc | {"note": "rewritten whole"}
    with pytest.raises(ValueError):
        resultfiles.merge({"configs": [1]}, {"configs": [None, {"a": 1}]})


def test_a_packed_folder_reads_as_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "runs"
    (folder / "autotune").mkdir(parents=True)
    (folder / "autotune" / "state.json").write_text('{"chunks": []}')
    archive = resultfiles.pack(folder)
    assert archive == tmp_path / "runs.tar.gz" and not folder.exists()
    for name in (folder, archive):
        with resultfiles.unpacked(name) as found:
            assert (found / "autotune" / "state.json").read_text() == '{"chunks": []}'
