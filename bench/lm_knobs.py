"""Benchmark: the language-model knobs (issue 40), each alone on a strong base and together in a pick, with MFU.

For one workload and preset (default: ``gpt`` ``full``, the 512-dim 8-layer byte-level GPT of
autotune/workloads/gpt, 512-token context) it probes, each config `--repeats` times:

    base                         a strong config (default on a GPU: bf16, compile default, fused AdamW, the
                                 preset's effective batch as one micro-batch, a 4-worker pinned DataLoader
                                 where the workload has one; --base replaces it)
    attention_backend=V          base + V, for V in flash | efficient | cudnn | math
    inductor_tuning=V            base + V, for each TorchInductor tuning value (inactive unless compiled)
    hf_attn_implementation=V     (a Hugging Face model) base + each implementation but the model's own
    liger_kernels=true           (a Hugging Face model) base + Liger's kernels
    batch×M lr_scaling=R         base with M × the micro-batch, for R in none | linear | sqrt: throughput,
                                 and the quality the lr rule keeps at the larger batch
    combined                     base + every knob value that helped alone: at least --min-gain faster
                                 than base, active (its note not "inactive"), quality within --quality-tol
                                 of base's; per knob its fastest such value, the batch arm one change
                                 (--combined JSON names the changes instead, --combined-from takes what
                                 helped in earlier runs' JSONs); --ablate adds the combined minus each change

Order: round-robin, one round per repeat, base first in each (drift hits every config alike). Round
0 probes base and each knob value alone; the combined config is chosen from it; each later round
probes base, the pick's configs, then the single knobs lacking repeats (the last rounds may hold
base and the pick alone). Every probe is ``autotune probe --json`` in a process of its own, as
bench/probe_configs.py runs them (studylib.run_cli: forked from a server that imported torch once).
The inductor cache directory (TORCHINDUCTOR_CACHE_DIR) is one for the whole run, as in
probe_configs.py: a config's first probe compiles cold, its later rounds hit the warm FX-graph
cache, and configs whose generated kernels are alike share Triton's kernel cache (--inductor-cache
keeps one across runs). --deadline S: no probe starts S seconds after the benchmark started, and
after round 0 no single knob's probe starts when the pick's remaining probes would then end past
it; the JSON is rewritten after every probe, so a run cut short still leaves what it did.

Reported per config: median samples/s and tokens/s (samples × the sequence length), the ratio to
base's median, the run-to-run range, the workload's quality (gpt: val_loss), the MFU, the compile
(warm-up) seconds of its first probe, and the probe's notes for the knobs it changes (an inactive
knob reads "inactive: why").

MFU = model FLOPs per token × tokens/s ÷ the GPU's bf16 dense peak. Model FLOPs per token of a
training step (forward + backward), the PaLM paper's appendix-B convention:

    6·N  +  12·Σ_attention calls (H·Dh·T)  [+ 6·N_aux·p on the steps that run the auxiliary loss]

N: the weights of every matmul module (nn.Linear, HF Conv1D) outside the auxiliary head: the
non-embedding parameters and the LM head (a head tied to the embedding counts: it is a matmul per
token); embeddings and norms are not matmuls. H·Dh and T (query heads × head dim, key length) and
the number of attention calls come from the scaled_dot_product_attention calls of one forward of
one sample, on the CPU. The causal mask is NOT halved (the PaLM convention; halving it is
``attention_halved`` in the JSON). N_aux: the matmul weights of the workload's auxiliary-loss head
(gpt: the ``mtp`` multi-token-prediction head), p the fraction of positions it sees (gpt: T−1 of
T), counted on the fraction of steps that ran it (the probe's inverse_steps / steps:
inverse_loss_frequency). A FlopCounterMode forward (``flop_counter`` in the JSON) checks N.
Peak: NVIDIA's datasheets, the bf16 Tensor Core dense figure (half the "with sparsity" one):
H100 SXM and H200 989.4 TFLOPS, H100 PCIe 756, H100 NVL and H200 NVL 835.5, A100 312;
--peak-tflops for another GPU.

    python bench/lm_knobs.py --device cuda --knobs attention_backend lr_scaling --deadline 400 \\
        --out $OUT/lm_knobs_gpt_h200.json --png $OUT/lm_knobs_gpt_h200.png
    python bench/lm_knobs.py --device cuda --knobs inductor_tuning --out $OUT/lm_knobs_gpt_inductor_h200.json
    python bench/lm_knobs.py --device cuda --knobs none --combined-from A.json B.json --ablate --repeats 3 ...
    python bench/lm_knobs.py --workload hf-causal-lm --device cuda --out ...   # preset gpu; + HF's knobs
    python bench/lm_knobs.py --workload gpt-script --device cuda --out ...     # examples/gpt_script, preset tiny
    python bench/lm_knobs.py --knobs attention_backend=flash,cudnn lr_scaling --batch-multipliers 2 ...
    python bench/lm_knobs.py --from results/lm_knobs_gpt_h200.json --png F.png  # the table (and PNG) again
    python bench/lm_knobs.py --device cpu --samples 320 --repeats 1 --batch-multipliers 2 --out /tmp/lmk.json
                                                            # CPU smoke: gpt tiny, eager fp32 base

The examples' workloads (gpt-script, hf-causal-lm) are registered by import path, with their
example folder on PYTHONPATH, when their package is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from probe_configs import run_one  # one probe: `autotune probe --json` in a process of its own
from studylib import environment, pyplot

ROOT = Path(__file__).resolve().parents[1]

# workload -> (its package under examples/, the import path of its workload class)
EXAMPLES = {"gpt-script": ("gpt_script", "gpt_script.workload:ScriptWorkload"),
            "hf-causal-lm": ("hf_causal_lm", "hf_causal_lm.workload:Llama")}
# (workload, "cpu" | "cuda") -> the preset when --preset is not given
DEFAULT_PRESETS = {("gpt", "cuda"): "full", ("gpt", "cpu"): "tiny", ("hf-causal-lm", "cuda"): "gpu",
                   ("hf-causal-lm", "cpu"): "tiny"}

# the values each knob is probed at (its default, the base's, left out)
KNOB_VALUES: dict[str, list[Any]] = {
    "attention_backend": ["flash", "efficient", "cudnn", "math"],
    "inductor_tuning": ["coordinate_descent", "max_autotune_gemm", "max_autotune_gemm+coordinate_descent"],
    "hf_attn_implementation": ["sdpa", "eager", "flex_attention"],
    "liger_kernels": [True],
    "lr_scaling": ["none", "linear", "sqrt"],
}
HF_KNOBS = ("hf_attn_implementation", "liger_kernels")
BATCH = "batch"  # the lr_scaling arm's change: the micro-batch and its lr rule, one change

# bf16 Tensor Core dense TFLOPS from NVIDIA's datasheets (the "with sparsity" figure halved), by a
# substring of torch.cuda.get_device_name(); the first match wins (the variants before the family)
PEAKS_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.5), ("H200 NVL", 835.5), ("H100", 989.4), ("H200", 989.4),
                ("A100", 312.0)]
PEAK_SOURCE = ("NVIDIA datasheets (H100, H200, A100): BF16 Tensor Core TFLOPS, the dense figure (half the one "
               "'with sparsity')")
FLOPS_CONVENTION = ("6·N + 12·Σ_attn(H·Dh·T) per token, forward + backward (PaLM, appendix B; causal attention not "
                    "halved), + 6·N_aux·p on the steps that run the auxiliary loss")


# -- the workload ---------------------------------------------------------------------------------------

def register(workload: str) -> dict[str, str]:
    """Make an example's workload (gpt-script, hf-causal-lm) resolvable here and in the probes: its
    folder on PYTHONPATH when its package is not installed, its import path in AUTOTUNE_WORKLOADS
    when no entry point names it. Returns the probes' extra environment (this process's os.environ
    and sys.path are set too)."""
    env: dict[str, str] = {}
    if workload not in EXAMPLES:
        return env
    package, target = EXAMPLES[workload]
    if importlib.util.find_spec(package) is None:
        folder = str(ROOT / "examples" / package)
        sys.path.insert(0, folder)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, str(ROOT), os.environ.get("PYTHONPATH", "")]))
    from autotune.contract.registry import export_workload_paths, registered_workloads

    entry = registered_workloads().get(workload)
    if entry is None or (entry.source != "entry_point" and not entry.target):
        export_workload_paths({workload: target})
        env["AUTOTUNE_WORKLOADS"] = os.environ["AUTOTUNE_WORKLOADS"]
    return env


def one_sample(wl: Any) -> dict[str, Any]:
    """A batch of one training sample, on the CPU, as the probe hands the model its batches."""
    import torch
    from torch.utils.data import default_collate

    from autotune.engine.sampled_data import has_own_data_path

    if has_own_data_path(wl):
        return dict(wl.sample_batch(1, torch.Generator().manual_seed(0), torch.device("cpu")))
    return dict(default_collate([wl.datasets(0)[0][0]]))


def flop_model(workload: str, preset: str) -> dict[str, Any]:
    """The model's FLOPs per token (module docstring), from the model the workload builds (on the CPU)
    and one forward of one sample: N, the auxiliary head's N_aux and the positions it sees, every
    scaled_dot_product_attention call's heads × head dim and key length, the sequence length; a
    FlopCounterMode forward's matmul FLOPs per token beside 2·N; whether it is a Hugging Face model."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.overrides import TorchFunctionMode
    from torch.utils.flop_counter import FlopCounterMode

    from autotune.contract.registry import get_workload
    from autotune.engine.hf_checkpointing import hf_models
    from autotune.engine.lm_knobs import attn_implementation

    wl = get_workload(workload, preset)
    torch.manual_seed(0)
    model = wl.build_model()
    aux_name = getattr(wl, "aux_loss_name", None)
    modules = dict(model.named_modules())
    aux_prefix = aux_name if aux_name and aux_name in modules else None

    def in_aux(name: str) -> bool:
        return aux_prefix is not None and (name == aux_prefix or name.startswith(aux_prefix + "."))

    n_main = n_aux = 0
    for name, m in modules.items():
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":  # HF's GPT-2 Conv1D is a matmul too
            if in_aux(name):
                n_aux += m.weight.numel()
            else:
                n_main += m.weight.numel()
    batch = one_sample(wl)
    seq = next(int(v.shape[1]) for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim >= 2)
    calls: list[dict[str, Any]] = []

    class Attention(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                q, k = args[0], args[1] if len(args) > 1 else kwargs["key"]
                calls.append({"heads": int(q.shape[-3]), "head_dim": int(q.shape[-1]), "queries": int(q.shape[-2]),
                              "keys": int(k.shape[-2]), "causal": bool(kwargs.get("is_causal", False))})
            return func(*args, **kwargs)

    seen: list[int] = []
    hook = modules[aux_prefix].register_forward_hook(
        lambda mod, inp, out: seen.append(int(inp[0].numel() // inp[0].shape[-1]))) if aux_prefix else None
    model.train()
    with torch.no_grad():
        with Attention(), FlopCounterMode(display=False) as counter:
            model(batch, False)
        if hook is not None:
            model(batch, True)  # the auxiliary head's positions
            hook.remove()
    counts = {str(k): int(v) for k, v in counter.get_flop_counts().get("Global", {}).items()}
    matmul = sum(v for k, v in counts.items() if k.split(".")[-1] in ("mm", "addmm", "bmm", "baddbmm", "matmul"))
    attention = 12 * sum(c["heads"] * c["head_dim"] * c["keys"] for c in calls)
    hf = hf_models(model)
    return {
        "workload": workload, "preset": preset, "sequence_length": seq,
        "params_total": sum(p.numel() for p in model.parameters()),
        "n_matmul": n_main, "n_aux": n_aux, "aux_head": aux_prefix,
        "aux_positions_fraction": (seen[0] / seq) if seen else (1.0 if n_aux else 0.0),
        "attention_calls": calls[:1] + ([{"more": len(calls) - 1}] if len(calls) > 1 else []),
        "attention_layers": len(calls),
        "dense_per_token": 6 * n_main, "attention_per_token": attention, "attention_halved": attention // 2,
        "aux_per_token_when_run": 6 * n_aux * ((seen[0] / seq) if seen else 1.0),
        "convention": FLOPS_CONVENTION,
        "flop_counter": {"forward_matmul_per_token": matmul / seq, "two_n": 2 * n_main, "by_op": counts,
                         "note": "FlopCounterMode on one CPU forward without the auxiliary loss: its matmul FLOPs "
                                 "per token should be 2·N (the CPU's attention kernel is not in its table)"},
        "hf": [{"class": type(m).__name__, "attn_implementation": attn_implementation(m),
                "model_type": getattr(getattr(m, "config", None), "model_type", None)} for m in hf],
    }


def flops_per_token(fm: dict[str, Any], aux_step_fraction: float) -> float:
    return float(fm["dense_per_token"] + fm["attention_per_token"] + fm["aux_per_token_when_run"] * aux_step_fraction)


def peak_of(gpu: str, override: float | None) -> tuple[float | None, str]:
    """(bf16 dense peak FLOP/s, its source) for the GPU's name; (None, why) where unknown."""
    if override:
        return override * 1e12, f"--peak-tflops {override:g}"
    for key, tflops in PEAKS_TFLOPS:
        if key.lower() in gpu.lower():
            return tflops * 1e12, f"{key}: {tflops:g} TFLOPS bf16 dense ({PEAK_SOURCE})"
    return None, f"no bf16 peak known for {gpu!r} (pass --peak-tflops)"


# -- the configs ------------------------------------------------------------------------------------------

def default_base(wl: Any, device: str) -> dict[str, Any]:
    """The strong base: the preset's effective batch as one micro-batch (so the preset's lr fits it);
    on a GPU bf16, compile default (so inductor_tuning can act: a max-autotune mode sets its flags
    already), fused AdamW and, where the workload has a DataLoader, 4 pinned persistent workers."""
    from autotune.engine.sampled_data import has_own_data_path

    d = wl.defaults
    base: dict[str, Any] = {"batch_size": d.batch_size * d.accum_steps, "accum_steps": 1}
    if device != "cpu":
        base.update(precision="bf16", compile="default", fused_optimizer=True)
        if not has_own_data_path(wl):
            base.update(num_workers=4, prefetch_factor=4, pin_memory=True, persistent_workers=True)
    return base


def parse_knobs(items: list[str] | None, hf: bool, own_attn: str | None) -> dict[str, list[Any]]:
    """--knobs: NAME (its values) or NAME=V1,V2, or none (base and the pick alone); default every knob
    (HF's only for an HF model)."""
    if items and [i.lower() for i in items] == ["none"]:
        return {}
    if not items:
        chosen = {k: list(v) for k, v in KNOB_VALUES.items() if hf or k not in HF_KNOBS}
        if own_attn in chosen.get("hf_attn_implementation", []):
            chosen["hf_attn_implementation"].remove(own_attn)  # the model's own: base already runs it
        return chosen
    chosen = {}
    for item in items:
        for part in filter(None, item.split(" ")):
            name, _, values = part.partition("=")
            if name not in KNOB_VALUES:
                raise SystemExit(f"--knobs {part}: unknown knob {name!r}; known: {', '.join(KNOB_VALUES)}")
            allowed = {str(v).lower(): v for v in KNOB_VALUES[name]}
            picked = [allowed.get(v.strip().lower()) for v in values.split(",")] if values else list(KNOB_VALUES[name])
            if None in picked:
                raise SystemExit(f"--knobs {part}: {name} takes {', '.join(map(str, KNOB_VALUES[name]))}")
            chosen.setdefault(name, []).extend(v for v in picked if v not in chosen.get(name, []))
    return chosen


def single_configs(base: dict[str, Any], knobs: dict[str, list[Any]], multipliers: list[int]) -> dict[str, Any]:
    """{name: spec} of base and each knob value alone; a spec: config, group, changes."""
    specs: dict[str, Any] = {"base": {"config": dict(base), "group": "base", "changes": {}}}
    for knob, values in knobs.items():
        if knob == "lr_scaling":
            continue
        for value in values:
            name = f"{knob}={json.dumps(value) if isinstance(value, bool) else value}"
            specs[name] = {"config": {**base, knob: value}, "group": knob, "changes": {knob: value}}
    for m in multipliers if "lr_scaling" in knobs else []:
        for rule in knobs["lr_scaling"]:
            changes = {"batch_size": base["batch_size"] * m, "lr_scaling": rule}
            specs[f"batch×{m} lr_scaling={rule}"] = {"config": {**base, **changes}, "group": BATCH,
                                                     "changes": changes}
    return specs


def combined_from(paths: list[Path], base: dict[str, Any], min_gain: float, tol: float
                  ) -> tuple[dict[str, Any], list[str]]:
    """The pick from earlier runs (--combined-from): what helped alone in each (`choose_combined` on
    its probes), together; a run with another base is refused."""
    from resultfiles import load

    changes: dict[str, Any] = {}
    why: list[str] = []
    for path in paths:
        earlier = load(path)
        if earlier["base"] != base:
            raise SystemExit(f"--combined-from {path}: its base {json.dumps(earlier['base'])} is not this run's "
                             f"{json.dumps(base)}")
        found, reasons = choose_combined(earlier, min_gain, tol)
        changes.update(found)
        why += [f"{path.name}: {r}" for r in reasons]
    return changes, why


def check_samples(configs: dict[str, Any], samples: int) -> None:
    """Exit before any probe when a config's effective batch leaves its probe too few timed steps."""
    from autotune.contract.config import ConfigError
    from autotune.contract.protocol import ProbeSpec
    from autotune.contract.steps import plan_steps

    spec = ProbeSpec()
    for name, c in configs.items():
        try:
            plan_steps(samples, c["config"]["batch_size"] * c["config"].get("accum_steps", 1), spec.warmup_steps,
                       spec.windows, c["config"].get("inverse_loss_frequency", 1))
        except ConfigError as e:
            raise SystemExit(f"{name}: {e}") from None


def quality_ok(q: float | None, base_q: float | None, direction: str, tol: float) -> bool:
    if q is None or base_q is None or not math.isfinite(q):
        return False
    return q <= base_q + tol if direction == "minimize" else q >= base_q - tol


def choose_combined(doc: dict[str, Any], min_gain: float, tol: float) -> tuple[dict[str, Any], list[str]]:
    """The changes of the knob values that helped alone (module docstring): per knob (the batch arm one
    change), the fastest that is active, ≥ min_gain faster than base and within tol of base's quality.
    Returns (changes, why: a line per knob)."""
    rows = {r["name"]: r for r in summarize(doc)}
    base = rows.get("base")
    changes: dict[str, Any] = {}
    why: list[str] = []
    if not base or not base.get("samples_per_s"):
        return changes, ["base has no measurement: nothing to compare"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for name, spec in doc["configs"].items():
        if spec["group"] not in ("base", "combined", "ablation") and name in rows:
            groups.setdefault(spec["group"], []).append(rows[name])
    for group, candidates in groups.items():
        good = [r for r in candidates if r.get("ratio") and r["ratio"] >= 1 + min_gain and r["status"] == "active"
                and quality_ok(r.get("quality"), base.get("quality"), doc["quality_direction"], tol)]
        if not good:
            best = max((r for r in candidates if r.get("ratio")), key=lambda r: r["ratio"], default=None)
            why.append(f"{group}: none helped" + (f" (best {best['name']} {best['ratio']:.3f}×, {best['status']}, "
                                                  f"quality {fmt(best.get('quality'))})" if best else ""))
            continue
        pick = max(good, key=lambda r: (round(r["ratio"], 3), -(r.get("quality") or 0)))
        changes.update(doc["configs"][pick["name"]]["changes"])
        why.append(f"{group}: {pick['name']} ({pick['ratio']:.3f}×, quality {fmt(pick.get('quality'))})")
    return changes, why


# -- probing ----------------------------------------------------------------------------------------------

def write(path: Path | None, doc: dict[str, Any]) -> None:
    if path is None:
        return
    doc["summary"] = summarize(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


PICK = ("combined", "ablation")  # the groups of the pick's configs


class Schedule:
    """Probes in rounds until every config has its repeats or the deadline passes, appending each result
    to doc["runs"] and rewriting the JSON. Round 0: base and each knob value alone. Then the combined
    config is chosen (`decide`), and each later round runs base, the pick's configs, then the single
    knobs that lack repeats; the last rounds may hold base and the pick alone. Past the deadline no
    probe starts; after round 0, a single knob's probe does not start either when the pick's remaining
    probes would then end past it (`pick_reserve`)."""

    def __init__(self, doc: dict[str, Any], args: argparse.Namespace, env: dict[str, str], started: float) -> None:
        self.doc, self.args, self.env = doc, args, env
        self.started = started  # the benchmark's start (time.monotonic): --deadline counts from it
        self.decided = False

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def count(self, name: str) -> int:
        return sum(1 for r in self.doc["runs"] if r.get("name") == name and "skipped" not in r)

    def walls(self) -> tuple[float, float]:
        """(the longest probe's wall seconds so far: a cold compile; a warm probe's, the median of later rounds')."""
        runs = [r for r in self.doc["runs"] if r.get("wall_s") and not r.get("failure")]
        if not runs:
            return 0.0, 0.0
        warm = [r["wall_s"] for r in runs if r.get("round", 0) > 0 and r.get("name") in ("base", "combined")]
        return max(r["wall_s"] for r in runs), statistics.median(warm) if warm else min(r["wall_s"] for r in runs)

    def pick_names(self) -> list[str]:
        return [n for n, spec in self.doc["configs"].items() if spec["group"] in PICK]

    def pick_reserve(self) -> float:
        """Seconds the pick's remaining probes need (and a base probe beside each of its rounds): its
        first probe a cold compile, the others warm."""
        if not self.decided or not self.pick_names():  # round 0 first: the pick is chosen from it
            return 0.0
        cold, warm = self.walls()
        names = self.pick_names()
        seconds = 0.0
        for name in names:
            left = self.args.repeats - self.count(name)
            if left > 0:
                seconds += (cold if self.count(name) == 0 else warm) + (left - 1) * warm
        rounds = max((self.args.repeats - self.count(n) for n in names), default=0)
        return seconds + rounds * warm  # base beside each

    def probe(self, name: str, rnd: int) -> None:
        args = self.args
        reserve = 0.0 if name == "base" or self.doc["configs"][name]["group"] in PICK else self.pick_reserve()
        if args.deadline and self.elapsed() + reserve > args.deadline:
            self.doc["runs"].append({"name": name, "round": rnd,
                                     "skipped": f"deadline: {self.elapsed():.0f} s of {args.deadline:g} s"
                                                + (f" ({reserve:.0f} s kept for the pick)" if reserve else "")})
            return
        result = run_one(self.doc["configs"][name]["config"], args, self.env)
        result.update(name=name, round=rnd)
        self.doc["runs"].append(result)
        tp, fail = result.get("throughput_samples_per_s"), result.get("failure")
        print(f"[{self.elapsed():5.0f} s] {name:44s} r{rnd}: {(f'{tp:,.1f} samples/s') if tp else '-':>20s} "
              f"warm-up {result.get('warmup_s') or 0:6.1f} s  {doc_quality(result)}  wall "
              f"{result['wall_s']:5.1f} s {(fail or {}).get('kind', '')}", flush=True)
        write(args.out, self.doc)

    def run(self, decide: Any) -> None:
        """`decide()`: choose the pick (adds its configs to doc["configs"]), after round 0."""
        singles = [n for n in self.doc["configs"] if n != "base" and self.doc["configs"][n]["group"] not in PICK]
        rnd = 0
        while True:
            pick = self.pick_names()
            todo = [n for n in [*pick, *singles] if self.count(n) < self.args.repeats
                    and not any(r.get("name") == n and "skipped" in r for r in self.doc["runs"])]
            if rnd > 0 and not todo:
                break
            if rnd == 0 or self.count("base") < self.args.repeats or todo:
                self.probe("base", rnd)
            for name in todo:
                self.probe(name, rnd)
            if not self.decided:
                decide()
                self.decided = True
            rnd += 1
            if self.args.deadline and self.elapsed() > self.args.deadline:
                break
        # what the deadline left out, said so once each
        for name in [*self.pick_names(), *singles]:
            if self.count(name) < self.args.repeats and not any(r.get("name") == name and "skipped" in r
                                                                for r in self.doc["runs"]):
                self.doc["runs"].append({"name": name, "round": rnd, "skipped": "deadline: no round left"})


def doc_quality(result: dict[str, Any]) -> str:
    q = result.get("quality")
    return f"{result.get('quality_metric') or 'quality'} {q:.4f}" if isinstance(q, (int, float)) else "quality -"


# -- the summary ------------------------------------------------------------------------------------------

def fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def knob_notes(spec: dict[str, Any], run: dict[str, Any]) -> tuple[str, bool]:
    """(the probe's notes for the knobs the config changes, whether any of them says it did not act)."""
    notes = run.get("knobs") or {}
    parts, inactive = [], False
    for knob in spec["changes"]:
        if knob == "batch_size":
            parts.append(f"batch_size {spec['changes'][knob]}")
            continue
        note = str(notes.get(knob, "(no note)"))
        inactive |= "inactive" in note or "no effect" in note or "not applied" in note
        parts.append(f"{knob}: {note}")
    return "; ".join(parts), inactive


def summarize(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A row per config: medians over its measured probes, the ratio to base's median, quality, MFU, notes."""
    fm, peak = doc["flops"], doc.get("peak_flops")
    seq = fm["sequence_length"]
    rows = []
    for name, spec in doc["configs"].items():
        runs = [r for r in doc["runs"] if r.get("name") == name]
        done = [r for r in runs if "skipped" not in r]
        ok = [r for r in done if not r.get("failure") and r.get("throughput_samples_per_s")]
        row: dict[str, Any] = {"name": name, "group": spec["group"], "changes": spec["changes"],
                               "probes": len(ok), "failed": len(done) - len(ok),
                               "skipped": len(runs) - len(done)}
        if ok:
            tps = [r["throughput_samples_per_s"] for r in ok]
            tp = statistics.median(tps)
            qs = [r["quality"] for r in ok if isinstance(r.get("quality"), (int, float))]
            aux = statistics.median([(r.get("inverse_steps") or 0) / r["steps"] if r.get("steps") else 1.0
                                     for r in ok])
            fpt = flops_per_token(fm, aux)
            notes, inactive = knob_notes(spec, ok[-1])
            row.update(samples_per_s=tp, tokens_per_s=tp * seq, run_to_run=(max(tps) - min(tps)) / tp,
                       throughputs=tps, quality=statistics.median(qs) if qs else None,
                       quality_metric=ok[0].get("quality_metric"), aux_step_fraction=aux,
                       flops_per_token=fpt, model_tflops=fpt * tp * seq / 1e12,
                       mfu=fpt * tp * seq / peak if peak else None,
                       mfu_attention_halved=(fpt - fm["attention_halved"]) * tp * seq / peak if peak else None,
                       warmup_s_first=ok[0].get("warmup_s"), warmup_s=[r.get("warmup_s") for r in ok],
                       peak_mem_gib=max((r.get("peak_mem_reserved_bytes") or 0) for r in ok) / 2**30,
                       effective_batch=(ok[0].get("config") or {}).get("effective_batch"),
                       lr=(ok[0].get("config") or {}).get("lr"), lr_note=(ok[-1].get("knobs") or {}).get("lr"),
                       notes=notes, status="inactive" if inactive else "active")
        else:
            fail = next((r["failure"] for r in done if r.get("failure")), None)
            row.update(status="failed" if fail else "not run",
                       notes=f"{fail['kind']}: {str(fail.get('message', ''))[:300]}" if fail else
                       next((r["skipped"] for r in runs if "skipped" in r), ""))
        if spec["group"] == "base":
            row["status"] = "base" if ok else row["status"]
        rows.append(row)
    base = next((r for r in rows if r["name"] == "base" and r.get("samples_per_s")), None)
    for row in rows:
        if base and row.get("samples_per_s"):
            row["ratio"] = row["samples_per_s"] / base["samples_per_s"]
            if isinstance(row.get("quality"), float) and isinstance(base.get("quality"), float):
                row["quality_delta"] = row["quality"] - base["quality"]
            row["quality_ok"] = quality_ok(row.get("quality"), base.get("quality"),
                                           doc.get("quality_direction", "minimize"), doc.get("quality_tol", 0.01))
    return rows


def table(doc: dict[str, Any]) -> str:
    rows = doc.get("summary") or summarize(doc)
    metric = next((r["quality_metric"] for r in rows if r.get("quality_metric")), "quality")
    lines = [f"| config | samples/s | tokens/s | × base | run-to-run | {metric} (✗: beyond base's + "
             f"{doc.get('quality_tol', 0.01):g}) | MFU | compile s | n | notes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        notes = r.get("notes") or ""
        if r["status"] == "inactive":
            notes = "**INACTIVE** " + notes
        elif r["status"] in ("failed", "not run"):
            notes = f"**{r['status'].upper()}** {notes}"
        notes = notes.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['name']} | {fmt(r.get('samples_per_s'), ',.0f')} | {fmt(r.get('tokens_per_s'), ',.0f')} "
                     f"| {fmt(r.get('ratio'), '.3f')} | {fmt(r.get('run_to_run'), '.1%')} | {fmt(r.get('quality'))}"
                     f"{' ✗' if r.get('quality_ok') is False else ''} "
                     f"| {fmt(r.get('mfu'), '.1%')} | {fmt(r.get('warmup_s_first'), '.0f')} "
                     f"| {r['probes']}{'+' + str(r['failed']) + ' failed' if r['failed'] else ''} "
                     f"| {notes[:240]} |")
    return "\n".join(lines)


def header(doc: dict[str, Any]) -> str:
    fm = doc["flops"]
    env = doc["environment"]
    eff = doc["base"]["batch_size"] * doc["base"].get("accum_steps", 1)
    aux = (f" + aux head {fm['aux_head']}: 6 × {fm['n_aux']:,} × {fm['aux_positions_fraction']:.4f} = "
           f"{fm['aux_per_token_when_run'] / 1e6:.2f} MFLOP on the steps that run it") if fm["n_aux"] else ""
    attn = fm["attention_calls"][0] if fm["attention_calls"] else None
    attn_text = (f"12 × {fm['attention_layers']} layers × {attn['heads']} heads × {attn['head_dim']} × "
                 f"{attn['keys']} = {fm['attention_per_token'] / 1e6:.2f} MFLOP (not halved for the causal mask)"
                 if attn else "0 (no scaled_dot_product_attention call seen)")
    return "\n".join([
        f"{doc['workload']} {doc['preset']} on {env.get('gpu')} (torch {env.get('torch')}), {doc['repeats']} "
        f"repeats, {doc.get('samples') or 'the preset’s'} samples; base {json.dumps(doc['base'])}",
        f"model FLOPs per token (fwd+bwd): 6·N = 6 × {fm['n_matmul']:,} = {fm['dense_per_token'] / 1e6:.2f} MFLOP; "
        f"attention {attn_text}{aux}; {fm['params_total']:,} parameters in all; sequence {fm['sequence_length']}",
        f"peak: {doc.get('peak_source')}",
    ] + ([f"note: base's effective batch {eff} is not the preset's {doc['preset_effective_batch']} (the batch its lr "
          "was set for, and lr_scaling's reference)"] if eff != doc["preset_effective_batch"] else []))


def plot(doc: dict[str, Any], path: Path) -> None:
    from PIL import Image

    plt = pyplot()
    rows = [r for r in (doc.get("summary") or summarize(doc))]
    colors = {"base": "#444444", "active": "#2a7ab9", "inactive": "#bbbbbb", "failed": "#d62728",
              "not run": "#eeeeee"}
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.6))
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows, strict=True):
        ratio = r.get("ratio") or 0.0
        color = "#2ca02c" if r["group"] == "combined" and ratio else colors.get(r["status"], "#2a7ab9")
        ax.barh(y, ratio, color=color)
        label = (f"{ratio:.2f}×" + (f" · MFU {r['mfu']:.1%}" if r.get("mfu") is not None else "")
                 + (f" · {r['quality']:.3f}" if isinstance(r.get("quality"), float) else "")
                 + (" ✗" if r.get("quality_ok") is False else "")
                 + (" · inactive" if r["status"] == "inactive" else "")) if ratio else r["status"]
        ax.text(max(ratio, 0) + 0.01, y, label, va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8, ls="--")
    ax.set_yticks(ys, [r["name"] for r in rows], fontsize=8)
    top = max([r.get("ratio") or 0 for r in rows] + [1.0])
    ax.set_xlim(0, top * 1.45)
    ax.set_xlabel(f"median samples/s ÷ base's (labels: MFU, {rows[0].get('quality_metric') or 'quality'})")
    fm = doc["flops"]
    ax.set_title(f"{doc['workload']} {doc['preset']} · {doc['environment'].get('gpu')} · "
                 f"{(fm['dense_per_token'] + fm['attention_per_token']) / 1e6:.1f} MFLOP/token "
                 f"(6N + 12·L·H·Dh·T, N={fm['n_matmul'] / 1e6:.1f} M)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)


def report(doc: dict[str, Any], png: Path | None) -> None:
    doc["summary"] = summarize(doc)
    print()
    print(header(doc))
    print()
    print(table(doc))
    if doc.get("combined"):
        # chosen after round 0 (one run a config): its ratios are that round's, not the table's medians
        print("\ncombined (chosen after round 0, from that round's ratios):", json.dumps(doc["combined"]["changes"]),
              "·", " · ".join(doc["combined"]["why"]))
    if png:
        try:
            plot(doc, png)
        except ImportError as e:  # no matplotlib here: the JSON has it all (--from JSON --png elsewhere)
            print(f"\nno PNG: {e}")
        else:
            print(f"\nwrote {png}")


# -- main -------------------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="gpt", help="gpt, gpt-script, hf-causal-lm, or any registered LM workload")
    p.add_argument("--preset", default=None, help="default: gpt full (tiny on a CPU), hf-causal-lm gpu (tiny on a "
                                                  "CPU), gpt-script tiny")
    p.add_argument("--device", default="cuda")
    p.add_argument("--samples", type=int, default=None, help="training samples per probe (default: the preset's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--base", type=str, default=None, help="the base config, JSON (default: module docstring)")
    p.add_argument("--knobs", nargs="*", default=None,
                   help="NAME or NAME=V1,V2 (default: every knob; HF's only for an HF model)")
    p.add_argument("--batch-multipliers", type=str, default="2,4", help="lr_scaling's batch sizes: × base's")
    p.add_argument("--combined", type=str, default=None, help="the pick's changes to base, JSON (default: the "
                                                              "knob values that helped alone)")
    p.add_argument("--combined-from", type=Path, nargs="+", default=None,
                   help="the pick: what helped in these earlier runs' JSONs (same base), together")
    p.add_argument("--no-combined", action="store_true", help="probe the single knobs only")
    p.add_argument("--ablate", action="store_true", help="also probe the combined config minus each change")
    p.add_argument("--min-gain", type=float, default=0.02, help="a knob value helps when this much faster")
    p.add_argument("--quality-tol", type=float, default=0.01, help="... and its quality within this of base's")
    p.add_argument("--deadline", type=float, default=None, help="seconds from the start: no new probe after it")
    p.add_argument("--timeout", type=float, default=300.0, help="per probe, seconds")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's bf16 dense peak, if not in the table")
    p.add_argument("--inductor-cache", type=Path, default=None,
                   help="TORCHINDUCTOR_CACHE_DIR for every probe (default: a new one for this run)")
    p.add_argument("--out", type=Path, default=None, help="the JSON, rewritten after every probe")
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--from", dest="from_", type=Path, default=None, help="report a finished run's JSON again")
    args = p.parse_args()
    started = time.monotonic()

    if args.from_:
        from resultfiles import load

        report(load(args.from_), args.png)
        return
    kind = "cpu" if args.device == "cpu" else "cuda"
    args.preset = args.preset or DEFAULT_PRESETS.get((args.workload, kind), "tiny")
    extra_env = register(args.workload)
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(args.inductor_cache or env.get("TORCHINDUCTOR_CACHE_DIR")
                                         or tempfile.mkdtemp(prefix="inductor-"))
    from autotune.contract.registry import get_workload

    wl = get_workload(args.workload, args.preset)
    wl.datasets(0)  # generate the workload's data once, outside every timed probe
    fm = flop_model(args.workload, args.preset)
    hf = bool(fm["hf"])
    base = json.loads(args.base) if args.base else default_base(wl, args.device)
    base.setdefault("batch_size", wl.defaults.batch_size * wl.defaults.accum_steps)
    base.setdefault("accum_steps", 1)
    knobs = parse_knobs(args.knobs, hf, fm["hf"][0]["attn_implementation"] if hf else None)
    multipliers = [int(m) for m in args.batch_multipliers.split(",") if m.strip()]
    configs = single_configs(base, knobs, multipliers)
    check_samples(configs, args.samples or wl.defaults.samples)
    envdoc = environment(args.device)
    peak, peak_source = peak_of(envdoc["gpu"], args.peak_tflops) if args.device != "cpu" else (
        None, "no bf16 peak for a CPU: no MFU")
    doc: dict[str, Any] = {
        "benchmark": "lm_knobs", "argv": sys.argv[1:], "environment": envdoc,
        "workload": args.workload, "preset": args.preset, "device": args.device, "samples": args.samples,
        "repeats": args.repeats, "base": base, "knobs": knobs, "batch_multipliers": multipliers,
        "preset_effective_batch": wl.defaults.batch_size * wl.defaults.accum_steps, "preset_lr": wl.defaults.lr,
        "quality_direction": getattr(wl, "quality_direction", "minimize"),
        "min_gain": args.min_gain, "quality_tol": args.quality_tol, "deadline_s": args.deadline,
        "inductor_cache": "shared by every probe of this run: a config's first probe compiles cold",
        "flops": fm, "peak_flops": peak, "peak_source": peak_source, "configs": configs, "runs": [],
        "combined": None,
    }
    print(header(doc), flush=True)
    print(f"{len(configs)} configs × {args.repeats} repeats: {', '.join(configs)}", flush=True)
    write(args.out, doc)
    schedule = Schedule(doc, args, env, started)

    def decide() -> None:
        if args.no_combined:
            return
        if args.combined:
            changes, why = json.loads(args.combined), ["given (--combined)"]
        elif args.combined_from:
            changes, why = combined_from(args.combined_from, base, args.min_gain, args.quality_tol)
        else:
            changes, why = choose_combined(doc, args.min_gain, args.quality_tol)
        doc["combined"] = {"changes": changes, "why": why}
        if not changes:
            print(f"\nno combined config: nothing helped alone ({'; '.join(why)})", flush=True)
            return
        doc["configs"]["combined"] = {"config": {**base, **changes}, "group": "combined", "changes": changes}
        if args.ablate:
            for key in {BATCH if k in ("batch_size", "lr_scaling") else k for k in changes}:
                keep = {k: v for k, v in changes.items() if (BATCH if k in ("batch_size", "lr_scaling") else k) != key}
                if keep:
                    doc["configs"][f"combined − {key}"] = {"config": {**base, **keep}, "group": "ablation",
                                                           "changes": keep}
        print(f"\ncombined: {json.dumps(changes)} ({'; '.join(why)})\n", flush=True)

    if args.combined or args.combined_from:
        decide()  # given: probed from round 0, beside the single knobs
        schedule.decided = True
    schedule.run(decide)
    doc["elapsed_s"] = schedule.elapsed()
    write(args.out, doc)
    report(doc, args.png)


if __name__ == "__main__":
    main()
