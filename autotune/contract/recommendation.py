"""The verdict as a config file: `recommendation_yaml` (what `/best?format=yaml` and `autotune
best` print) and `uncertified_yaml` (`autotune best --uncertified`). Only a certified pick's
config is ever written as the config to train with; without one the file holds the baseline's
own config under a header that says why (never a slower config)."""

from __future__ import annotations

import json
from typing import Any

import yaml

from autotune.contract.config import knobs_of
from autotune.contract.views import Provenance, Recommendation


def recommendation_yaml(rec: Recommendation) -> str:
    """The config to train with as YAML that `autotune probe --config FILE` reads, under a
    header with the verdict and the numbers behind it. Without a certified pick it is the
    baseline's own config (never a slower one): `uncertified_yaml` has the fastest uncertified
    candidate for those who want it."""
    if not rec.certified:
        lines = [f"# autotune verdict for study {rec.study}: KEEP THE BASELINE ({rec.outcome})",
                 f"# {rec.reason}",
                 "# the config below is the baseline's own (trial "
                 f"{rec.trial_number}); `autotune best --uncertified` prints the fastest uncertified candidate"]
    else:
        picked = " (the lowest energy per sample among the certified)" if rec.chosen_by == "energy" else ""
        lines = [f"# autotune verdict for study {rec.study}: CERTIFIED, trial {rec.trial_number}{picked}",
                 f"# {rec.verdict}"]
    lines += _number_lines(rec)
    if rec.certified and rec.check is not None:
        lines.append(CHECK_PREFIX + json.dumps(check_record(rec), separators=(",", ":"), sort_keys=True))
    body = yaml.safe_dump(rec.config, sort_keys=False, default_flow_style=False) if rec.config else "{}\n"
    return "\n".join(lines) + "\n" + body


CHECK_PREFIX = "# autotune-check: "  # best.yaml's one machine-read line: what `autotune check` re-measures


def check_record(rec: Recommendation) -> dict[str, Any]:
    """The certified pick's record for `autotune check` (one JSON object on best.yaml's
    ``# autotune-check:`` line): its study, speedup and interval, quality rule, the baseline
    and judged budget (`CheckInputs`) and the provenance it was measured with."""
    assert rec.check is not None
    return {"study": rec.study, "trial": rec.trial_number, "speedup": rec.speedup,
            "speedup_ci": [rec.speedup_ci_low, rec.speedup_ci_high], "quality_metric": rec.quality_metric,
            "quality_direction": rec.quality_direction, "check": rec.check.model_dump(mode="json"),
            "provenance": rec.provenance.model_dump(mode="json")}


def read_check_record(text: str) -> dict[str, Any] | None:
    """The ``# autotune-check:`` record of a best.yaml's text (None: it has none)."""
    for line in text.splitlines():
        if line.startswith(CHECK_PREFIX):
            value = json.loads(line[len(CHECK_PREFIX):])
            return value if isinstance(value, dict) else None
    return None


def uncertified_yaml(rec: Recommendation) -> str:
    """The fastest uncertified candidate's config, labelled so (`autotune best --uncertified`)."""
    row = rec.uncertified
    if row is None:
        return (f"# autotune study {rec.study}: no uncertified candidate (every candidate was certified or none "
                "ran)\n{}\n")
    speed = "n/a" if row.speedup is None else f"{row.speedup:.2f}x"
    if row.speedup_ci_low is not None and row.speedup_ci_high is not None:
        speed += f", interval {row.speedup_ci_low:.2f}-{row.speedup_ci_high:.2f}x"
    lines = [f"# UNCERTIFIED: trial {row.trial_number} of study {rec.study} ({row.status}): not shown faster and no "
             "worse than the baseline beyond the noise",
             f"# {row.reason}" if row.reason else "# (no reason recorded)",
             f"# {row.n} runs; speedup {speed}"]
    config = knobs_of(row.config)
    return "\n".join(lines) + "\n" + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def _number_lines(rec: Recommendation) -> list[str]:
    lines = []
    if rec.baseline_throughput_samples_per_s is not None:
        lines.append(f"# throughput: {rec.throughput_samples_per_s:.1f} samples/s; baseline "
                     f"{rec.baseline_throughput_samples_per_s:.1f} samples/s (geometric means over their runs)")
    lines += [f"# {line}" for line in rec.energy_lines()]
    name = rec.quality_metric
    side = "<=" if rec.quality_direction == "minimize" else ">="
    gate = f" (bound: {side} {rec.gate_quality:.6g})" if rec.gate_quality is not None else ""
    base = "n/a" if rec.baseline_quality is None else f"{rec.baseline_quality:.6g}"
    if rec.baseline_quality_std is not None and rec.baseline_seeds > 1:
        base += f" ± {rec.baseline_quality_std:.2g} over {rec.baseline_seeds} runs"
    value = "n/a" if rec.quality is None else f"{rec.quality:.6g}"
    lines.append(f"# {name}: {value}{gate}; baseline {name}: {base}")
    for row in rec.configs:
        thr = "n/a" if row.throughput_samples_per_s is None else f"{row.throughput_samples_per_s:.1f}"
        sd = "" if row.throughput_sd_log is None else f" sd(log) {row.throughput_sd_log:.3f}"
        q = "" if row.quality_mean is None else f", {name} {row.quality_mean:.6g}" + (
            "" if row.quality_sd is None else f" sd {row.quality_sd:.2g}")
        if row.quality_diff is not None and row.quality_diff_ci_high is not None and row.quality_margin is not None:
            q += (f"; {name} difference {row.quality_diff:+.4g} (bound {row.quality_diff_ci_high:+.4g}, margin "
                  f"{row.quality_margin:.4g})")
        lines.append(f"# {row.role} trial {row.trial_number} [{row.status}]: n {row.n}, {thr} samples/s{sd}{q}")
    lines.append("# peak memory reserved: " + ("n/a (not measured on this device)" if rec.peak_mem_reserved_bytes
                                                is None else f"{rec.peak_mem_reserved_bytes / 2**30:.2f} GiB"))
    lines += [f"# note: {note}" for note in rec.measurement_notes]
    lines += [f"# {line}" for line in provenance_lines(rec.provenance)]
    lines += [f"# caveat: {c}" for c in rec.caveats]
    if rec.config and rec.config.get("lr") is not None:
        lines.append("# lr: the probes' (the workload preset's); autotune.apply keeps your optimizer's lr "
                     "unless use_config_lr=True")
    return lines


def provenance_lines(p: Provenance) -> list[str]:
    """What the verdict was measured on, in words (best.yaml's header): versions, device,
    workload and the fingerprints, and which runs they come from; n/a where not recorded."""
    def na(value: object) -> str:
        return "n/a" if value is None else str(value)

    if p.gpu_count is None:
        count = ""
    elif p.gpu_count == 0:
        count = " (CPU study)"
    else:
        count = f" x {p.gpu_count} GPU{'s' if p.gpu_count != 1 else ''}"
    host = f"; host CPU {p.host_cpu}" if p.host_cpu else ""
    lines = [f"provenance: workload {na(p.workload)}, preset {na(p.preset)}; torch {na(p.torch_version)}, "
             f"CUDA {na(p.cuda_version)}, driver {na(p.driver_version)}",
             f"device: {na(p.device)}{count}{host}",
             f"fingerprints: model {na(p.model_fingerprint)}, search space {na(p.space_fingerprint)}"]
    if p.source_trial is not None:
        base = "" if p.baseline_trial is None or p.baseline_trial == p.source_trial else \
            f"; baseline run: trial {p.baseline_trial}"
        lines.append(f"environment read from trial {p.source_trial}{base}")
    return lines  # a mixed study (p.mixed) is one of the recommendation's caveats
