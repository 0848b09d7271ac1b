"""How the worker shows a trial in words: its parameters, where its probe is (`describe_progress`,
also used by `autotune probe`), and its result in one line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.markup import escape

from autotune.contract.results import TrialLease


def progress_text(lease: TrialLease, elapsed_s: float, progress: dict[str, Any] | None) -> str:
    """Where a trial's probe is, in one line (`describe_progress`), with the seconds so far."""
    return f"trial {lease.number} of {lease.study}: {describe_progress(progress)} ({elapsed_s:.0f} s)"


def describe_progress(progress: Mapping[str, Any] | None) -> str:
    """A probe's progress message (autotune.engine.probe.ProgressCallback) in words: its phase, samples
    done of all, the timed window, the ETA of its training (validation not counted)."""
    if not progress:
        return "starting"
    phase = str(progress.get("phase"))
    parts = [phase if phase != "window" else f"timed window {progress.get('window')} of {progress.get('windows')}"]
    if phase == "warm-up" and progress.get("steps"):
        parts[0] += f" ({progress['steps']} steps: compile, autotuning)"
    if phase == "timed windows" and progress.get("windows"):
        parts[0] += f" ({progress['windows']}; warm-up took {float(progress.get('warmup_s') or 0):.1f} s)"
    done, total = progress.get("samples"), progress.get("total_samples")
    if isinstance(done, int) and isinstance(total, int) and total > 0:
        parts.append(f"{done:,} of {total:,} samples")
    eta = progress.get("eta_s")
    if isinstance(eta, (int, float)):
        parts.append(f"training ETA {eta:.0f} s")
    return " · ".join(parts)



def format_params(params: Mapping[str, Any], limit: int = 8) -> str:
    items = [f"{k}={v}" for k, v in list(params.items())[:limit]]
    if len(params) > limit:
        items.append("…")
    return " ".join(items) or "(defaults)"


def summarize_result(result: Mapping[str, Any]) -> str:
    """One line: throughput · NRMSE, or the failure, or pruned."""
    failure = result.get("failure")
    if failure:
        message = str(failure.get("message", "")).splitlines()[0][:300] if failure.get("message") else ""
        return f"[red]FAIL {escape(str(failure.get('kind')))}[/]: {escape(message)}"
    thr = result.get("throughput_samples_per_s")
    thr_text = f"{thr:,.1f} samples/s" if isinstance(thr, (int, float)) else "- samples/s"
    if result.get("stopped_early"):
        return f"[yellow]PRUNED[/] ({thr_text} before it stopped)"
    nrmse = result.get("quality", result.get("val_nrmse"))
    label = "NRMSE" if result.get("quality_metric", "val_nrmse") == "val_nrmse" else str(result["quality_metric"])
    nrmse_text = f"{escape(label)} {nrmse:.4f}" if isinstance(nrmse, (int, float)) else f"{escape(label)} -"
    warm = result.get("warmup_s")
    warm_text = f" · warm-up {warm:.2f} s" if isinstance(warm, (int, float)) else ""
    return f"[green]{thr_text}[/] · {nrmse_text}{warm_text}"
