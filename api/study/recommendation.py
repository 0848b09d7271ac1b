"""The study's verdict: the certified pick, or the baseline's own config with the reason."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from autotune.api.study.feasibility import baseline_summary, gate_quality
from autotune.api.study.front import RANK_METRIC, chosen_by, ranked_candidates, search_done
from autotune.api.study.remeasure import (
    Remeasurement,
    geomean,
    judged_metric,
    pooled_energy,
    remeasurement,
    run_values,
    windows_of,
)
from autotune.api.study.trials import (
    TrialRecord,
    baseline_target,
    baselines,
    batch_per_step,
    completed,
    knob_config,
    metric,
    quality_name,
    retries,
)
from autotune.contract.config import knobs_of
from autotune.contract.gate import Estimate
from autotune.contract.protocol import StudySpec
from autotune.contract.provenance import mixed_runs, space_fingerprint
from autotune.contract.space import Space
from autotune.contract.verdict import Judgement, Sample, t_ppf, welch
from autotune.contract.views import CheckInputs, ConfigVerdict, Provenance, Recommendation


class NoRecommendation(Exception):
    """There is nothing to recommend yet; the message says why and what to wait for."""


def baseline_failed_message(study_name: str, spec: StudySpec, trials: Sequence[TrialRecord]) -> str | None:
    """A message when every baseline seed finished without a result (the gate cannot be set)."""
    summary = baseline_summary(spec, trials)
    if summary.finished and summary.quality is None:
        return (f"study {study_name!r} cannot recommend anything: every baseline run failed "
                f"({'; '.join(summary.failures)}); the quality gate needs the baseline's "
                f"{quality_name(spec, trials)}. "
                "Fix what the failures name (the baseline's config in spec.baseline, its probe in spec.probe, "
                "the study's quality or the workload) and submit a new study")
    return None


def _config_verdict(spec: StudySpec, target: TrialRecord, runs: Sequence[TrialRecord], role_: str, status: str,
                    judgement: Judgement | None, reason: str = "") -> ConfigVerdict:
    """One row of the verdict's inputs (Recommendation.configs)."""
    thr = run_values(runs, spec, "throughput_samples_per_s")
    qual = run_values(runs, spec, "quality")
    logs = [math.log(v) for v in thr]
    j = judgement
    return ConfigVerdict(
        trial_number=target.number, role=role_, status=status, reason=reason or (j.reason if j else ""),  # type: ignore[arg-type]
        config=knob_config(target) or {}, n=len(thr), throughput_samples_per_s=geomean(thr),
        throughput_sd_log=statistics.stdev(logs) if len(logs) > 1 else None, throughputs=thr,
        quality_mean=statistics.fmean(qual) if qual else None,
        quality_sd=statistics.stdev(qual) if len(qual) > 1 else None, qualities=qual,
        speedup=j.ratio if j else None, speedup_ci_low=j.ratio_low if j else None,
        speedup_ci_high=j.ratio_high if j else None, quality_diff=j.quality_diff if j else None,
        quality_diff_ci_high=j.quality_high if j else None, quality_margin=j.margin if j else None,
        alpha=j.alpha if j else None)


# A deferred candidate's row (remeasure.larger_batch_quality "remeasure"; api.study.front.deferred_candidates)
DEFERRED_NOTE = ("refused by the quality gate at the search's budget; a larger effective batch than the "
                 "baseline's, so its quality is judged at the re-measure budget")


def verdict_rows(spec: StudySpec, trials: Sequence[TrialRecord], rm: Remeasurement) -> list[ConfigVerdict]:
    """The decision rule's inputs, the baseline first, then the candidates in rank order."""
    rows = []
    base = next((t for t in rm.targets if t.number == rm.baseline), None)
    if base is not None:
        rows.append(_config_verdict(spec, base, rm.base_runs, "baseline", "baseline", None,
                                    f"{len(rm.base_runs)} runs at the judged budget"))
    for t in rm.targets:
        if t.number == rm.baseline:
            continue
        status = rm.status.get(t.number, "undecided")
        why = rm.dropped.get(t.number, "") if status == "failed" else \
            ("slower than a certified config: no longer measured" if status == "stopped" else "")
        j = rm.judgements.get(t.number)
        if t.number in rm.deferred:  # the reason says where its quality was judged
            why = (f"{DEFERRED_NOTE}; " + (why or (j.reason if j else "not judged yet"))).rstrip("; ")
        rows.append(_config_verdict(spec, t, rm.runs.get(t.number, []), "candidate", status, j, why))
    return rows


def recommend(study_name: str, spec: StudySpec, trials: Sequence[TrialRecord], space: Space | None = None
              ) -> Recommendation:
    """The study's verdict once its re-measurement has finished: the fastest certified candidate
    (the lowest energy per sample where energy picks: `chosen_by`), or, when none was
    certified, the baseline's own config with certified False and the fastest uncertified
    candidate beside it. With re-measurement off (remeasure.top_k 0) nothing is judged: the
    baseline's config again, the search's fastest candidate as the uncertified one. Raises
    NoRecommendation while there is nothing to say yet, or when the baseline failed. `space`: the
    study's parsed search space, for the provenance's space fingerprint (None: left out)."""
    runs = baselines(trials)
    if not runs:
        raise NoRecommendation(f"study {study_name!r} has no recommendation yet: its baseline trial has not been "
                               "leased; start a worker with the study's hardware class")
    failed = baseline_failed_message(study_name, spec, trials)
    if failed:
        raise NoRecommendation(failed)
    summary = baseline_summary(spec, trials)
    if not summary.finished:
        state = retries(spec, trials)
        waiting = [t.number for t in runs if not t.finished or state.is_pending(t)]
        raise NoRecommendation(f"study {study_name!r} has no recommendation yet: the baseline runs "
                               f"({len(runs)}/{spec.baseline_seeds} started; waiting for trials {waiting}) have not "
                               f"all finished; the quality gate needs their {quality_name(spec, trials)}")
    assert summary.quality is not None
    gate = gate_quality(spec, trials)
    by = chosen_by(spec)
    _, higher = judged_metric(spec)
    scored_pool = ranked_candidates(spec, trials, gate)
    search_over = search_done(spec, trials, spec.n_trials)
    if not scored_pool and not search_over:
        what = "a throughput" if by == "throughput" else "an energy per sample"
        raise NoRecommendation(f"study {study_name!r} has no feasible search trial with {what} yet "
                               "(baseline seeds are the reference, never a recommendation)")
    rm = remeasurement(spec, trials, gate)
    qname = quality_name(spec, trials)
    judged = [t for t in rm.targets if t.number != rm.baseline]  # the candidates the verdict measures again
    if (scored_pool or judged) and rm.pending:
        score0, first = scored_pool[0] if scored_pool else (metric(judged[0], spec, RANK_METRIC[by]) or 0.0, judged[0])
        so_far = (f"the fastest search trial so far is trial {first.number} at {score0:,.1f} samples/s"
                  if by == "throughput" else
                  f"the search trial with the lowest energy so far is trial {first.number} at {score0:.4g} J/sample")
        raise NoRecommendation(
            f"study {study_name!r} has no verdict yet: its top configs and the baseline are being re-measured "
            f"(round {rm.rounds_done + 1} of at most {rm.round_limit}; {rm.probes} re-measurements so far); {so_far}")
    base = baseline_target(trials)
    assert base is not None
    rows = verdict_rows(spec, trials, rm)
    base_runs = rm.base_runs or [t for t in runs if completed(t) and not retries(spec, trials).superseded(t)]
    certified = [r for r in rows if r.status == "certified"]
    sign = 1.0 if higher else -1.0
    caveats: list[str] = []
    if certified:
        pick_row = max(certified, key=lambda r: (sign * (r.throughput_samples_per_s or 0.0)
                                                 if higher else sign * _energy_of(rm, r, spec), -r.trial_number))
        outcome = "certified"
        reason = (f"trial {pick_row.trial_number} is certified: {rm.judgements[pick_row.trial_number].reason} "
                  f"(after {rm.rounds_done} round{'s' if rm.rounds_done != 1 else ''})")
    else:
        pick_row = None
        if spec.remeasure.top_k <= 0:
            outcome = "not_judged"
            reason = ("nothing was judged: re-measurement is off (remeasure.top_k 0), so no config was shown faster "
                      "beyond the noise; keep the baseline config, or turn re-measurement on")
        elif not scored_pool and not judged:
            outcome = "no_win"
            reason = (f"no search trial kept the baseline's {qname} (none passed the quality gate); keep the baseline "
                      "config, or widen the search")
        elif any(r.status == "undecided" for r in rows):
            outcome = "undecided"
            reason = undecided_reason(rows, rm.rounds_done, rm.round_limit, qname, sign)
        else:
            outcome = "no_win"
            whys = "; ".join(f"trial {r.trial_number}: {r.reason}" for r in rows if r.role == "candidate")
            reason = f"no config beat the baseline: {whys}; keep the baseline config"
    # the fastest uncertified candidate (what --uncertified prints)
    others = [r for r in rows if r.role == "candidate" and r.status != "certified" and r.n > 0]
    uncertified = max(others, key=lambda r: sign * (r.throughput_samples_per_s or 0.0)) if others else None
    if uncertified is None and pick_row is None and scored_pool:
        _, top = scored_pool[0]
        uncertified = _config_verdict(spec, top, [top], "candidate", "undecided", None,
                                      "not re-measured: the search's own measurement, flattered by being the fastest "
                                      "of many (winner's curse)")
    chosen = next(t for t in trials if t.number == (pick_row.trial_number if pick_row else base.number))
    pick_runs = rm.runs.get(chosen.number, []) if pick_row else base_runs
    base_row = rows[0] if rows and rows[0].role == "baseline" else _config_verdict(
        spec, base, base_runs, "baseline", "baseline", None)
    j = rm.judgements.get(chosen.number) if pick_row else None
    thr = (pick_row.throughput_samples_per_s if pick_row else base_row.throughput_samples_per_s) \
        or metric(chosen, spec, "throughput_samples_per_s") or 0.0
    base_thr = base_row.throughput_samples_per_s
    ci = _run_interval(run_values(pick_runs, spec, "throughput_samples_per_s"))
    if ci is None:  # one run: the interval over its windows (which leaves out the run-to-run spread)
        windows = [w for r in pick_runs for w in windows_of(r)]
        ci = Estimate.for_rate(windows) if len(windows) >= 2 else None
    run = pick_runs[-1] if pick_runs else chosen
    notes = [str(n) for n in run.user_attrs.get("measurement_notes") or []]
    energy = _energy_ratio(pick_runs, base_runs, spec) if pick_row else None
    saves = None if energy is None or energy[2] is None else energy[2] < 1.0
    methods = sorted({str(m) for r in [*pick_runs, *base_runs] if (m := r.user_attrs.get("energy_method"))})
    peak = run.user_attrs.get("peak_mem_reserved_bytes")
    quality = (pick_row.quality_mean if pick_row else base_row.quality_mean)
    base_quality = base_row.quality_mean if base_row.quality_mean is not None else summary.quality.mean
    base_sd = base_row.quality_sd if base_row.quality_sd is not None else summary.quality.std
    margin = j.margin if j is not None and j.margin is not None else None
    qsign = 1.0 if spec.quality_direction == "minimize" else -1.0
    gate_used = base_quality + qsign * margin if margin is not None else gate
    nrmse = qname == "val_nrmse"
    config = chosen.user_attrs.get("config") or {}
    provenance = run_provenance(spec, space, run, [*pick_runs, chosen] if pick_row else [chosen], base_runs)
    if provenance.mixed:
        caveats.append("mixed study: the pick's and the baseline's runs were measured in different environments ("
                       + "; ".join(provenance.mixed) + "), so the speedup compares unlike runs")
    if pick_row is not None and chosen.number in rm.deferred:
        q, b = metric(chosen, spec, "quality"), batch_per_step(chosen.user_attrs.get("config"))
        refused = (f"at the search's budget the quality gate refused it ({qname} {q:.4g} against {gate:.4g})"
                   if q is not None and gate is not None else "not by the search's gate")
        caveats.append(f"trial {chosen.number}'s quality was judged at the re-measure budget "
                       f"({spec.remeasure.samples_factor:g}× the search's samples, remeasure.larger_batch_quality "
                       f"'remeasure'): {refused}")
        caveats.append(f"its effective batch ({b} samples a step) trains fewer optimizer steps over the same samples "
                       "than the baseline's: its loss catches up with training length, and was shown as good at the "
                       "re-measure budget; check it at your own run's length (`autotune check`, or a longer probe)")
    if spec.remeasure.top_k <= 0 and scored_pool:
        caveats.append("not re-measured (remeasure.top_k is 0): the search's own measurements, and the fastest of many "
                       "noisy measurements is flattered by its luck (winner's curse)")
    return Recommendation(
        study=study_name, config=knobs_of(config), trial_number=chosen.number,
        throughput_samples_per_s=thr, val_nrmse=quality if nrmse else None,
        baseline_throughput_samples_per_s=base_thr, baseline_val_nrmse=base_quality if nrmse else None,
        speedup=j.ratio if j and higher else (1.0 if pick_row is None else _ratio_of(thr, base_thr)),
        gate_nrmse=gate_used if nrmse else None,
        quality_metric=qname, quality_direction=spec.quality_direction, quality=quality,
        baseline_quality=base_quality, baseline_quality_std=base_sd, gate_quality=gate_used,
        peak_mem_reserved_bytes=int(peak) if isinstance(peak, (int, float)) and not isinstance(peak, bool) else None,
        throughput_ci_low=ci.low if ci else None, throughput_ci_high=ci.high if ci else None,
        remeasured=bool(pick_row), remeasure_rounds=len(pick_runs) if pick_row else 0,
        round_throughputs=run_values(pick_runs, spec, "throughput_samples_per_s") if pick_row else [],
        baseline_val_nrmse_std=base_sd if nrmse else None, baseline_seeds=len(base_runs),
        measurement_notes=notes, caveats=caveats,
        speedup_ci_low=j.ratio_low if j and higher else None, speedup_ci_high=j.ratio_high if j and higher else None,
        beats_baseline=bool(pick_row) if higher else None,
        verdict=_verdict_sentence(outcome, reason, j if higher else None),
        quality_budget="remeasure" if spec.remeasure.samples_factor > 1 else "search",
        search_quality=metric(chosen, spec, "quality"), search_gate_quality=gate,
        search_throughput_samples_per_s=metric(chosen, spec, "throughput_samples_per_s"),
        baseline_remeasured=rm.baseline is not None and bool(rm.runs.get(rm.baseline)),
        chosen_by=by, energy_j_per_sample=pooled_energy(pick_runs, spec) if pick_row else None,
        baseline_energy_j_per_sample=pooled_energy(base_runs, spec),
        energy_ratio=energy[0] if energy else None, energy_ratio_ci_low=energy[1] if energy else None,
        energy_ratio_ci_high=energy[2] if energy else None, saves_energy=saves,
        energy_method=" + ".join(methods) or None,
        energy_verdict=_energy_sentence(energy, saves) if energy else "",
        certified=bool(pick_row), outcome=outcome, reason=reason, configs=rows,  # type: ignore[arg-type]
        rounds_run=rm.rounds_done, max_rounds=rm.round_limit, remeasure_probes=rm.probes, uncertified=uncertified,
        provenance=provenance,
        check=check_inputs(spec, base, pick_runs, pick_row.quality_margin) if pick_row else None,
    )


def check_inputs(spec: StudySpec, base: TrialRecord, pick_runs: Sequence[TrialRecord],
                 quality_margin: float | None = None) -> CheckInputs:
    """What `autotune check` needs to measure the certified pick against the baseline again: the
    baseline's config as it ran, the judged runs' budget and the decision rule's settings."""
    samples = (pick_runs[-1].user_attrs.get("samples_trained") if pick_runs else None) or spec.probe.samples
    return CheckInputs(
        baseline_config=knobs_of(base.user_attrs.get("config") or spec.baseline_config()),
        samples=samples if isinstance(samples, int) and not isinstance(samples, bool) else None,
        windows=spec.remeasure.windows or spec.probe.windows, warmup_steps=spec.probe.warmup_steps,
        seed=spec.probe.seed + spec.remeasure.seed_offset, abs_tol=spec.gate.abs_tol, k=spec.gate.k,
        quality_margin=quality_margin,
        confidence=spec.remeasure.confidence, hardware=spec.hardware, gpus_per_trial=spec.gpus_per_trial)


def run_provenance(spec: StudySpec, space: Space | None, source: TrialRecord, pick_runs: Sequence[TrialRecord],
                   base_runs: Sequence[TrialRecord]) -> Provenance:
    """The recommendation's provenance: the environment recorded by `source` (the run the
    recommendation's measurement notes come from), the study's workload, preset and space
    fingerprint, and what the pick's runs and the baseline's runs disagree on (`mixed`)."""
    attrs = source.user_attrs

    def text(name: str) -> str | None:
        value = attrs.get(name)
        return value if isinstance(value, str) else None

    count = attrs.get("gpu_count")
    labelled: dict[int, tuple[str, TrialRecord]] = {}  # a baseline kept as the pick: its runs are the baseline's
    for role_, runs in (("baseline", base_runs), ("pick", pick_runs)):
        for r in runs:
            labelled.setdefault(r.number, (role_, r))
    baseline = base_runs[-1].number if base_runs else None
    return Provenance(
        workload=spec.workload, preset=spec.preset, torch_version=text("torch_version"),
        cuda_version=text("cuda_version"), driver_version=text("driver_version"), device=text("device"),
        gpu_count=count if isinstance(count, int) and not isinstance(count, bool) else None,
        host_cpu=text("host_cpu"), model_fingerprint=text("model_fingerprint"),
        space_fingerprint=space_fingerprint(space) if space is not None else None,
        source_trial=source.number, baseline_trial=baseline,
        mixed=mixed_runs([(role_, n, r.user_attrs) for n, (role_, r) in sorted(labelled.items())]))


def _ratio_of(pick: float | None, base: float | None) -> float | None:
    """The pick's throughput over the baseline's (an energy-picked verdict's speedup, no interval)."""
    return pick / base if pick and base else None


def _run_interval(throughputs: Sequence[float]) -> Estimate | None:
    """The 95 % interval of a config's throughput from its runs (the unit of replication):
    Student t on the mean log throughput, around the geometric mean; None with fewer than 2 runs."""
    if len(throughputs) < 2:
        return None
    logs = Sample.of([math.log(v) for v in throughputs])
    half = t_ppf(0.975, logs.n - 1) * logs.sd / math.sqrt(logs.n)
    return Estimate(math.exp(logs.mean), math.exp(logs.mean - half), math.exp(logs.mean + half), logs.n)


def _energy_of(rm: Remeasurement, row: ConfigVerdict, spec: StudySpec) -> float:
    return geomean(run_values(rm.runs.get(row.trial_number, []), spec, "energy_j_per_sample")) or math.inf


def _energy_ratio(pick: Sequence[TrialRecord], base: Sequence[TrialRecord], spec: StudySpec
                  ) -> tuple[float, float | None, float | None] | None:
    """The pick's energy per sample over the baseline's (geometric means) with a Welch 95 % interval."""
    p, b = run_values(pick, spec, "energy_j_per_sample"), run_values(base, spec, "energy_j_per_sample")
    if not p or not b:
        return None
    ratio = (geomean(p) or 0.0) / (geomean(b) or 1.0)
    if len(p) < 2 or len(b) < 2:
        return ratio, None, None
    d = welch(Sample.of([math.log(v) for v in p]), Sample.of([math.log(v) for v in b]))
    low, high = d.bounds(0.025)
    try:
        return ratio, math.exp(low), math.exp(high)
    except OverflowError:  # the runs spread too widely for a finite interval: the ratio alone
        return ratio, None, None


def _energy_sentence(energy: tuple[float, float | None, float | None], saves: bool | None) -> str:
    ratio, low, high = energy
    if low is None or high is None:
        return f"{ratio:.2f}× the baseline's energy per sample; no confidence interval (fewer than 2 runs a side)"
    interval = f"{ratio:.2f}× (95 % CI {low:.2f}–{high:.2f}×) the baseline's energy per sample"
    if saves:
        return f"{interval}: less energy beyond the noise"
    if low > 1.0:
        return f"{interval}: more energy beyond the noise"
    return f"{interval}: not told apart from the baseline's beyond the noise"


def _verdict_sentence(outcome: str, reason: str, j: Judgement | None) -> str:
    """One sentence: the speedup with its interval and whether it is certified."""
    if outcome == "certified" and j is not None and j.ratio is not None:
        return (f"{j.ratio:.2f}× (interval {j.ratio_low:.2f}–{j.ratio_high:.2f}×) the baseline's throughput, "
                "certified: faster beyond the noise and no worse")
    if outcome == "certified":
        return "certified: " + reason
    return reason


def undecided_reason(rows: list[ConfigVerdict], rounds: int, limit: int, quality: str, sign: float) -> str:
    """Why nothing was certified when the fastest undecided config was neither shown a win nor
    a loss, naming the half that stayed open and what would close it: more rounds (either
    half), a quieter host (speed), or a wider gate.abs_tol when a quality difference of that
    size is acceptable to the user (quality)."""
    undecided = [r for r in rows if r.role == "candidate" and r.status == "undecided"]
    top = max(undecided, key=lambda r: (sign * (r.throughput_samples_per_s or 0.0), -r.trial_number))
    speed_open = top.speedup_ci_low is None or (top.speedup_ci_low <= 1.0 if sign > 0 else
                                                (top.speedup_ci_high or 1.0) >= 1.0)
    quality_open = top.quality_diff_ci_high is None or top.quality_margin is None \
        or top.quality_diff_ci_high >= top.quality_margin
    fixes = ["raise remeasure.max_rounds"]
    if speed_open:
        fixes.append("measure on a quieter host")
    if quality_open and not speed_open:
        fixes.append(f"widen gate.abs_tol if a {quality} difference of {top.quality_diff:+.3g} is acceptable to you"
                     if top.quality_diff is not None else "widen gate.abs_tol")
    half = ("neither its speed nor its quality was decided" if speed_open and quality_open else
            "its speed was not shown beyond the noise" if speed_open else f"its {quality} was not shown no worse")
    details, where = top.reason, ""
    if details.startswith(DEFERRED_NOTE):  # said once, as its own sentence, not nested in the details
        details = details.removeprefix(DEFERRED_NOTE).lstrip("; ")
        where = (" Its quality was judged at the re-measure budget: a larger effective batch than the baseline's, "
                 "refused by the quality gate at the search's budget.")
    return (f"no config was certified within the re-measure budget ({rounds} round{'s' if rounds != 1 else ''} of at "
            f"most {limit}). The fastest undecided, trial {top.trial_number}: {half}"
            + (f"; {details}" if details else "") + f".{where} Keep the baseline config, or " + ", or ".join(fixes))
