"""Benchmark (issue 40, item 3, its last part): a whole study with the language-model knobs in its
space against the same study without them, at equal GPU time, on one host.

Two studies of one workload through `autotune tune` (bench/warm_start_gpu.py's `tune`: one worker,
or --workers N, one per GPU, bounded in wall seconds), the same spec but for the space:

  plain     --space as shipped (default: h100 on a GPU; on a CPU a small inline space);
  widened   the same + attention_backend (every backend the device runs), inductor_tuning (none and
            each tuning; it acts under compile only), lr_scaling (none, linear, sqrt: the lr follows
            the effective batch), and for a Hugging Face model hf_attn_implementation (auto, sdpa,
            eager) and liger_kernels (off, on).

One after the other (--order; default plain first, so whatever the host warms up helps the widened
study), each with a TorchInductor cache of its own (no study profits from the other's compiles),
the same wall budget (--study-budget-s), n_trials, sampler seed and probe seeds. GPU-seconds are
the trials' lease-to-complete times from the database (warm_start_gpu.read_study).

Reported per study: the anytime curve (the best feasible search throughput after each completed
trial, against GPU-seconds) and its value at the GPU-seconds both studies spent (equal GPU time);
the verdict (certified or not, the pick's knobs, speedup and interval) and the GPU-seconds to it;
the pick's MFU: bench/lm_knobs.py's model FLOPs per token (its `flop_model`) × samples/s × the
sequence length ÷ the GPU's bf16 dense peak (lm_knobs.peak_of).

    python bench/lm_space_study.py --device cuda --out lm_space_study_h200.json             # gpt full, h100
    python bench/lm_space_study.py --device cpu --out /tmp/lm_space_cpu.json                 # the CPU smoke run
    python bench/lm_space_study.py --report lm_space_study_h200.json                         # the table again

A study that needs more than half of one bounded run (a lent GPU's 600 s a command) runs alone:
`--only plain`, then `--only widened` with the same --out. The second run adds its study to the
first's JSON, refused unless the settings (device, workload, preset, samples, n_trials, seed, budget,
spaces) and the GPU are the same; the two are compared once both are there.

    python bench/lm_space_study.py --device cuda --only plain --study-budget-s 540 --out lm_space_study_h200.json
    python bench/lm_space_study.py --device cuda --only widened --study-budget-s 540 --out lm_space_study_h200.json

A study that needs more than one bounded run resumes in the next: give both runs the same --workdir
(its database, carried from one machine to the next) and --tag.

--spec FILE (YAML) overrides keys of both studies' spec (a `baseline`, `remeasure`, `sampler`, `probe`, …); a
`space` in it is the plain study's (the widened one adds the knobs to it). So one study of a chosen space
against a chosen baseline (the batch arm as a study: bench/configs/lm_batch_gpt_full.yaml):

    python bench/lm_space_study.py --device cuda --only plain --spec bench/configs/lm_batch_gpt_full.yaml \
        --study-budget-s 520 --out lm_batch_study_h200.json

--require-gpu TEXT runs nothing (exit 3) unless the GPU's name holds TEXT: a lent machine that may be
an H100 or an H200 then costs seconds, not a study, when it is not the one the question needs.

Writes --out (JSON, rewritten after each study) and prints a table. Exit status: 0 when both
studies (with --only: that study) finished, 1 otherwise, 3 when --require-gpu refused the GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from lm_knobs import flop_model, flops_per_token, peak_of
from studylib import code_version
from warm_start_gpu import gpu_s_until, host_environment, read_study, space_knobs, tune, write

from autotune.contract.config import ATTENTION_BACKENDS, HF_ATTN_IMPLEMENTATIONS, INDUCTOR_TUNINGS, LR_SCALINGS

GROUPS = ("plain", "widened")
CPU_SPACE: dict[str, Any] = {  # the smoke run's: gpt tiny on a CPU, where a probe takes seconds
    "name": "gpt-tiny-cpu",
    "params": {"batch_size": {"choices": [8, 16, 32]}, "accum_steps": {"choices": [1, 2]},
               "fused_optimizer": {"choices": [False, True]}},
}
DEFAULTS: dict[str, dict[str, Any]] = {  # per device kind
    "cuda": {"preset": "full", "space": "h100", "samples": 6144, "n_trials": 14, "study_budget_s": 270.0},
    "cpu": {"preset": "tiny", "space": CPU_SPACE, "samples": 512, "n_trials": 6, "study_budget_s": 240.0},
}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def widened(space: str | dict[str, Any], device: str, hf: bool) -> dict[str, Any]:
    """`space` with the LM knobs added (module docstring), as an inline space."""
    from autotune.contract.space import load_space

    base: dict[str, Any] = (json.loads(json.dumps(space)) if isinstance(space, dict)
                            else load_space(space).to_dict())
    params = base.setdefault("params", {})
    backends = [b for b in ATTENTION_BACKENDS if device != "cpu" or b not in ("efficient", "cudnn")]
    params["attention_backend"] = {"choices": backends}
    compiled = [m for m in params.get("compile", {}).get("choices", []) if m in ("default", "reduce-overhead")]
    if compiled:  # tuning flags act on a compiled model only: the modes this space holds
        params["inductor_tuning"] = {"choices": list(INDUCTOR_TUNINGS), "when": {"compile": compiled}}
    params["lr_scaling"] = {"choices": list(LR_SCALINGS)}
    if hf:
        params["hf_attn_implementation"] = {"choices": [v for v in HF_ATTN_IMPLEMENTATIONS if v != "flex_attention"]}
        if device != "cpu":
            params["liger_kernels"] = {"choices": [False, True]}
    base["name"] = f"{base.get('name', 'space')}-lm"
    return base


def combinations(space: str | dict[str, Any]) -> int | None:
    """The product of the space's choice counts (conditions ignored: an upper bound); None with a range."""
    from autotune.contract.space import load_space, parse_space

    parsed = load_space(space) if isinstance(space, str) else parse_space(space)
    if any(p.choices is None for p in parsed.params.values()):
        return None
    return math.prod(len(p.choices or ()) for p in parsed.params.values())


def anytime(trials: list[dict[str, Any]]) -> list[list[float]]:
    """[GPU-seconds, best feasible search throughput so far] after each completed search trial."""
    best, curve = 0.0, []
    for t in sorted((t for t in trials if t["end_s"] is not None), key=lambda t: t["end_s"]):
        if t["role"] == "search" and t["state"] == "COMPLETE" and t["feasible"] and (t["throughput"] or 0) > best:
            best = float(t["throughput"])
            curve.append([gpu_s_until(trials, t["end_s"]) or 0.0, best])
    return curve


def best_at(curve: list[list[float]], gpu_s: float) -> float | None:
    """The best feasible search throughput a study had measured by `gpu_s`."""
    got = [v for s, v in curve if s <= gpu_s + 1e-9]
    return got[-1] if got else None


def summarize(study: dict[str, Any], run: dict[str, Any], mfu: Any) -> dict[str, Any]:
    trials = study["trials"]
    rec = study["recommendation"] or {}
    certified = bool(rec.get("certified"))
    pick = next((t for t in trials if certified and t["number"] == rec.get("trial_number")), None)
    ran = [t for t in trials if t["state"] != "REPEAT"]
    end = max((t["end_s"] for t in ran if t["end_s"] is not None), default=None)
    curve = anytime(trials)
    throughput = rec.get("throughput_samples_per_s") if certified else None
    return {
        "state": study["state"], "finished": study["state"] == "finished", "certified": certified,
        "outcome": rec.get("outcome", "no recommendation"), "reason": rec.get("reason"),
        "pick": space_knobs(pick) if pick else None, "pick_config": rec.get("config") if certified else None,
        "speedup": rec.get("speedup") if certified else None,
        "speedup_ci": [rec.get("speedup_ci_low"), rec.get("speedup_ci_high")] if certified else None,
        "pick_throughput": throughput, "pick_mfu": mfu(throughput, pick),
        "pick_quality": rec.get("quality") if certified else None, "baseline_quality": rec.get("baseline_quality"),
        "trials_run": len(ran), "failed": sum(t["state"] == "FAIL" for t in ran),
        "pruned": sum(t["state"] == "PRUNED" for t in ran),
        "gpu_s": gpu_s_until(trials, end) if end is not None else 0.0, "anytime": curve,
        "best_search_throughput": curve[-1][1] if curve else None,
        "provenance": rec.get("provenance"), "tune": run, "trials": trials,
    }


def mfu_of(workload: str, preset: str, gpu: str | None, device: str) -> Any:
    """A function (samples/s, the pick's trial) -> the MFU record, or None where it cannot be said."""
    try:
        fm = flop_model(workload, preset)
    except Exception as e:  # a workload lm_knobs cannot count: no MFU, said so
        why = f"{type(e).__name__}: {e}"[:300]
        return lambda *_: {"error": why}
    peak, source = peak_of(gpu or "", None) if device != "cpu" else (None, "a CPU: no bf16 Tensor Core peak")

    def mfu(samples_per_s: float | None, trial: dict[str, Any] | None) -> dict[str, Any] | None:
        if samples_per_s is None:
            return None
        cfg = (trial or {}).get("config") or {}
        aux = 1.0 / max(1, int(cfg.get("inverse_loss_frequency") or 1))
        flops = flops_per_token(fm, aux) * samples_per_s * fm["sequence_length"]
        return {"flops_per_token": flops_per_token(fm, aux), "tokens_per_s": samples_per_s * fm["sequence_length"],
                "model_tflops": flops / 1e12, "mfu": flops / peak if peak else None, "peak": source}

    return mfu


def table(doc: dict[str, Any]) -> str:
    rows, equal = doc["studies"], doc.get("equal_gpu_s")
    lines = [f"**{doc['environment'].get('gpu') or doc['settings']['device']}**, {doc['settings']['workload']} "
             f"{doc['settings']['preset']}, n_trials {doc['settings']['n_trials']}, "
             f"{doc['settings']['samples']} samples/probe, {doc['settings']['study_budget_s']:.0f} s a study", "",
             f"| study | combinations (≤) | trials (failed/pruned) | GPU-s | best search samples/s at "
             f"{f'{equal:.0f} GPU-s' if equal else 'equal GPU-s (both studies needed)'} | certified | pick | "
             f"speedup [95 % CI] | MFU |",
             "|---|---:|---:|---:|---:|---|---|---:|---:|"]
    for g in GROUPS:
        r = rows.get(g)
        if r is None:
            continue
        at = r.get("best_at_equal_gpu_s")
        ci = r.get("speedup_ci") or [None, None]
        sp = f"{r['speedup']:.2f}× [{ci[0]:.2f}–{ci[1]:.2f}]" if r.get("speedup") else "–"
        mfu = (r.get("pick_mfu") or {}).get("mfu")
        pick = ", ".join(f"{k} {v}" for k, v in (r.get("pick") or {}).items()) or "–"
        lines.append(f"| {g} | {doc['settings']['space_sizes'].get(g) or '–'} | {r['trials_run']} ({r['failed']}/"
                     f"{r['pruned']}) | {r['gpu_s']:.0f} | {f'{at:,.0f}' if at else '–'} | "
                     f"{'yes' if r['certified'] else r['outcome']} | {pick} | {sp} | "
                     f"{f'{mfu:.1%}' if mfu is not None else '–'} |")
    return "\n".join(lines)


SAME_SETTINGS = ("device", "workload", "preset", "samples", "n_trials", "seed", "study_budget_s", "spaces", "spec")


def load_overrides(path: str | None) -> dict[str, Any]:
    """--spec: a YAML mapping of study-spec keys ({} without one); SystemExit naming the fix otherwise."""
    if path is None:
        return {}
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SystemExit(f"--spec {path}: cannot read it ({e}); give a YAML file of study-spec keys") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--spec {path}: a mapping of study-spec keys (baseline, remeasure, space, …) is needed, "
                         f"not {type(data).__name__}")
    for key in ("name", "workload", "preset"):
        if key in data:
            raise SystemExit(f"--spec {path}: {key!r} is the benchmark's own (use --workload/--preset); remove it")
    return data


def merged(spec: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`spec` with --spec's keys: a mapping (probe, gate, remeasure, …) merged into the default's, the rest
    replaced."""
    out = dict(spec)
    for key, value in overrides.items():
        default = out.get(key)
        out[key] = default | value if isinstance(default, dict) and isinstance(value, dict) else value
    return out


def earlier_studies(doc: dict[str, Any], out: Path, only: str) -> dict[str, Any]:
    """With --only: the other study from an earlier run's --out, when its settings and GPU are this
    run's (else SystemExit naming the difference); {} when there is no earlier file or it holds no
    other study."""
    if not out.exists():
        return {}
    prev = json.loads(out.read_text())
    if not set(prev.get("studies") or {}) - {only}:  # nothing to compare with: this run replaces it (a
        return {}                                    # study resumed with another budget, say)
    for key in SAME_SETTINGS:
        # a file written before --spec existed has no "spec": it ran without one
        before, now = (d.get("settings", {}).get(key, {} if key == "spec" else None) for d in (prev, doc))
        if before != now:
            raise SystemExit(f"{out}: its {key} is {before!r}, this run's {now!r}; the two studies are compared "
                             f"only at the same settings: give the same options, or another --out")
    if prev.get("environment", {}).get("gpu") != doc["environment"].get("gpu"):
        raise SystemExit(f"{out}: its study ran on {prev.get('environment', {}).get('gpu')!r}, this one on "
                         f"{doc['environment'].get('gpu')!r}: compare studies on one kind of GPU (or another --out)")
    doc["earlier_argv"] = prev.get("argv")
    return {g: r for g, r in (prev.get("studies") or {}).items() if g != only}


def compare(doc: dict[str, Any]) -> None:
    """Both studies' best feasible search throughput at the GPU-seconds both spent."""
    rows = [r for r in doc["studies"].values() if "anytime" in r]
    if len(rows) == len(GROUPS):
        doc["equal_gpu_s"] = min(r["gpu_s"] for r in rows)
        for r in rows:
            r["best_at_equal_gpu_s"] = best_at(r["anytime"], doc["equal_gpu_s"])


def run(args: argparse.Namespace) -> int:
    from autotune.contract.registry import get_workload
    from autotune.engine.hf_checkpointing import hf_models

    t0 = time.monotonic()
    env = host_environment(args.device)  # first: a machine --require-gpu refuses builds and writes nothing
    if args.require_gpu and args.require_gpu.lower() not in str(env.get("gpu") or "").lower():
        print(f"--require-gpu {args.require_gpu}: this machine's GPU is {env.get('gpu') or 'unknown'}; "
              "nothing run", file=sys.stderr)
        return 3
    kind = "cpu" if args.device == "cpu" else "cuda"
    d = DEFAULTS[kind]
    preset, samples = args.preset or d["preset"], args.samples or d["samples"]
    n_trials, budget = args.n_trials or d["n_trials"], args.study_budget_s or d["study_budget_s"]
    overrides = load_overrides(args.spec)
    space = overrides.pop("space", None) or args.space or d["space"]
    hf = bool(hf_models(get_workload(args.workload, preset).build_model()))
    spaces = {"plain": space, "widened": widened(space, args.device, hf)}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="lm-space-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tag = args.tag or uuid.uuid4().hex[:4]
    base_spec: dict[str, Any] = {
        "workload": args.workload, "preset": preset, "sampler": "tpe", "seed": args.seed, "n_trials": n_trials,
        "baseline_seeds": 3, "probe": {"samples": samples, "timeout_s": args.probe_timeout_s},
        "starting_points": "auto", "warm_start": "none"}
    if kind == "cpu":
        base_spec["hardware"] = "cpu"
    base_spec = merged(base_spec, overrides)
    specs = {g: base_spec | {"name": f"lm-{tag}-{g}", "space": spaces[g]} for g in GROUPS}
    doc: dict[str, Any] = {
        "benchmark": "lm_space_study", "argv": sys.argv[1:], "environment": env | code_version(),
        "settings": {"device": args.device, "workload": args.workload, "preset": preset,
                     "samples": base_spec["probe"]["samples"], "n_trials": base_spec["n_trials"],
                     "study_budget_s": budget, "workers": args.workers, "spec": overrides, "order": args.order,
                     "seed": args.seed,
                     "spaces": spaces, "space_sizes": {g: combinations(spaces[g]) for g in GROUPS},
                     "workdir": str(work)},
        "studies": {}}
    mfu = mfu_of(args.workload, preset, env.get("gpu"), args.device)
    out = Path(args.out)
    order: tuple[str, ...] = GROUPS if args.order == "plain-first" else GROUPS[::-1]
    if args.only:
        doc["studies"] = earlier_studies(doc, out, args.only)
        order = (args.only,)
    db_url = f"sqlite:///{work / 'tune' / 'autotune.db'}"
    for g in order:
        ran = tune(specs[g], work, budget,  # the study's own compiles
                   env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{g}")}, workers=args.workers)
        try:
            doc["studies"][g] = summarize(read_study(db_url, specs[g]["name"]), ran, mfu)
        except Exception as e:  # the study was never created (its tune failed at once)
            doc["studies"][g] = {"tune": ran, "error": f"{type(e).__name__}: {e}"[:500], "finished": False}
        write(doc, out)
    compare(doc)
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    write(doc, out)
    print(table(doc))
    if args.only:
        return 0 if doc["studies"][args.only].get("finished") else 1
    return 0 if all(r.get("finished") for r in doc["studies"].values()) and len(doc["studies"]) == 2 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--workload", default="gpt")
    p.add_argument("--preset", default=None, help="default: full on a GPU, tiny on a CPU")
    p.add_argument("--space", default=None, help="the plain space's name (default: h100 on a GPU)")
    p.add_argument("--spec", default=None, help="a YAML file of study-spec keys for both studies (its space: "
                                                 "the plain study's)")
    p.add_argument("--samples", type=int, default=None, help="probe samples (default: cuda 6144, cpu 512)")
    p.add_argument("--n-trials", type=int, default=None, help="each study's (default: cuda 14, cpu 6)")
    p.add_argument("--study-budget-s", type=float, default=None, help="each study's wall limit (cuda 270, cpu 240)")
    p.add_argument("--probe-timeout-s", type=float, default=180.0)
    p.add_argument("--workers", type=int, default=1, help="local workers per study (on a GPU host at most one "
                                                          "per GPU: each runs its probes on a GPU of its own)")
    p.add_argument("--order", choices=("plain-first", "widened-first"), default="plain-first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=GROUPS, default=None,
                   help="run this study alone; an --out holding the other (same settings) gets this one added")
    p.add_argument("--workdir", default=None)
    p.add_argument("--tag", default=None, help="the studies' names are lm-TAG-plain and lm-TAG-widened (default: "
                                               "random); the same --workdir and --tag again resume a study that a "
                                               "bounded run cut short (`autotune tune` resumes it)")
    p.add_argument("--out", default=None)
    p.add_argument("--require-gpu", default=None, metavar="TEXT",
                   help="run only if the GPU's name holds TEXT (e.g. H200); otherwise exit 3 at once")
    p.add_argument("--report", type=Path, default=None, help="print a finished run's table again")
    args = p.parse_args(argv)
    if args.report:
        print(table(json.loads(args.report.read_text())))
        return 0
    if not args.out:
        p.error("--out is required (or --report)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
