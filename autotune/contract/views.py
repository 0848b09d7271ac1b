"""What the service answers about studies and trials: StudyInfo/StudyList, TrialInfo/TrialList and
the Recommendation, with each config's part in the verdict (ConfigVerdict). The service builds
these itself, so they are plain response models (the requests' strict checks are in
`autotune.contract.protocol` and `autotune.contract.results`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from autotune.contract.protocol import StudySpec

# StudyInfo.counts' state for a lost trial (its worker died, or it was interrupted) whose re-run is
# still to be leased: not a failure of the study, and not yet a finished configuration
LOST_TO_RERUN = "LOST"
# StudyInfo.counts' state for a re-measurement stopped early because the verdict no longer needed it
# (PRUNED in Optuna): another worker's run decided its config, or the verdict, first. Not a config
# pruned for its speed or quality. Its prune_reason starts with UNNEEDED_REASON.
UNNEEDED = "UNNEEDED"
UNNEEDED_REASON = "not needed: "


def stopped_unneeded(prune_reason: str | None) -> bool:
    """Whether a trial's prune reason says the verdict stopped it as no longer needed (UNNEEDED)."""
    return bool(prune_reason) and str(prune_reason).startswith(UNNEEDED_REASON)


class StudyInfo(BaseModel):
    name: str
    state: Literal["running", "stopped", "finished"]
    spec: StudySpec
    counts: dict[str, int] = Field(default_factory=dict, description=(
        f"trials by state; {LOST_TO_RERUN}: lost with no fault of its config, its re-run still to be leased; "
        f"{UNNEEDED}: a re-measurement stopped early because the verdict no longer needed it (PRUNED in Optuna)"))
    remeasures: int = Field(0, description="of the trials in counts, the verdict's re-measurements (on top of "
                                           "spec.n_trials, which counts the baseline seeds and search trials)")
    failures: dict[str, int] = Field(default_factory=dict, description="failed trials by failure kind")
    retried: int = Field(0, description="lost trials re-run as a new trial (not in counts nor failures: "
                                        "their retry stands for them)")
    best: dict[str, Any] | None = None
    message: str | None = Field(None, description="why the study has no recommendation, when it cannot get one")
    notes: list[str] = Field(default_factory=list, description="what the spec will spend trials on that cannot "
                                                               "succeed (e.g. configs its probe budget cannot time)")


class StudyList(BaseModel):
    data: list[StudyInfo]
    count: int


class TrialInfo(BaseModel):
    trial_id: int
    number: int
    state: str
    params: dict[str, Any]
    config: dict[str, Any] | None = None
    values: list[float] | None = None
    throughput_samples_per_s: float | None = None
    val_nrmse: float | None = Field(None, description="the quality metric when it is val_nrmse (else None)")
    quality: float | None = Field(None, description="the study's quality metric (see quality_metric)")
    quality_metric: str | None = None
    energy_j_per_sample: float | None = Field(None, description="GPU joules per sample (None: not measured)")
    feasible: bool | None = None
    failure: dict[str, str] | None = None
    worker_id: str | None = None
    is_baseline: bool = False
    role: Literal["baseline", "search", "remeasure"] = "search"
    prune_reason: str | None = None
    remeasure_of: int | None = Field(None, description="the trial number a remeasure trial re-measures")
    remeasure_round: int | None = Field(None, description="a remeasure trial's round (0, 1, …)")
    starting_point: int | None = Field(None, description="which of the study's starting points this search "
                                                         "trial ran (0 = the first; None: the sampler's draw)")
    warm_start_from: str | None = Field(None, description="the earlier study whose pick or front config this "
                                                          "starting point is (StudySpec.warm_start)")
    repeat_of: int | None = Field(None, description="the measured trial whose params the sampler drew again: this "
                                                    "trial was told its result and not run")
    baseline_repeat_of: int | None = Field(None, description="the baseline trial whose config this search trial "
                                             "drew: it measures the baseline again and is never a candidate")
    feasibility_note: str | None = Field(None, description="how `feasible` was judged when not by the study's gate "
                                         "(a re-measurement: against the baseline at its own budget, or not judged)")
    duration_s: float | None = None
    attempt: int = Field(1, description="1 for a first run; k for the (k-1)-th retry of a lost trial")
    retry_of: int | None = Field(None, description="the lost trial number this trial re-runs")
    retried_as: int | None = Field(None, description="the trial number that re-runs this lost trial")
    to_rerun: bool = Field(False, description="a lost trial whose re-run is still to be leased (counted as "
                                              f"{LOST_TO_RERUN} in the study's counts, not as a failure)")


class TrialList(BaseModel):
    data: list[TrialInfo]
    count: int


class ConfigVerdict(BaseModel):
    """One config's part in the verdict (autotune.contract.verdict): its runs at the judged budget and what
    the decision rule made of them. The baseline's row has no speedup or quality difference."""

    trial_number: int = Field(..., description="the search trial (or the baseline's first seed) it stands for")
    role: Literal["baseline", "candidate"]
    status: Literal["baseline", "certified", "rejected", "undecided", "failed", "stopped"] = Field(
        ..., description="certified: faster and no worse beyond the noise; rejected: shown slower or worse; "
        "undecided: neither yet; failed: a run failed; stopped: no longer measured (slower than a certified config)")
    reason: str = ""
    config: dict[str, Any] = Field(default_factory=dict)
    n: int = Field(0, description="runs at the judged budget (a candidate's search trial is not one of them: "
                                  "it was chosen for its speed)")
    throughput_samples_per_s: float | None = Field(None, description="geometric mean over the runs")
    throughput_sd_log: float | None = Field(None, description="sample sd of log throughput over the runs (about the "
                                            "relative run-to-run spread)")
    throughputs: list[float] = Field(default_factory=list, description="each run's throughput")
    quality_mean: float | None = None
    quality_sd: float | None = None
    qualities: list[float] = Field(default_factory=list)
    speedup: float | None = Field(None, description="the judged metric's ratio over the baseline's (throughput; "
                                  "energy per sample in an energy-picked study) with its interval")
    speedup_ci_low: float | None = None
    speedup_ci_high: float | None = None
    quality_diff: float | None = Field(None, description="mean quality minus the baseline's, signed so that > 0 is "
                                       "worse")
    quality_diff_ci_high: float | None = Field(None, description="the upper end of that difference's interval")
    quality_margin: float | None = Field(None, description="the non-inferiority margin: max(abs_tol, k × the "
                                         "baseline's sd at this budget)")
    alpha: float | None = Field(None, description="the one-sided level each test used at the last look (the study's "
                                "error rate spent over configs and looks)")


class Provenance(BaseModel):
    """What a recommendation was measured on and against (best.yaml's header names it too): the
    environment of the run it is read from (`source_trial`: the pick's last run; the baseline's
    last run when the baseline is kept), the study's workload, preset and search space. Each
    field is None where the runs did not record it (a worker older than these fields). `mixed`
    lists what the verdict's runs (the pick's and the baseline's) disagree on: a mixed study,
    whose speedup compares unlike environments."""

    workload: str | None = None
    preset: str | None = None
    torch_version: str | None = None
    cuda_version: str | None = Field(None, description="torch.version.cuda of the probe (None: a CPU build)")
    driver_version: str | None = Field(None, description="the NVIDIA driver's version: NVML's, else the kernel "
                                       "module's (None: no GPU, or neither answered)")
    device: str | None = Field(None, description="the GPU's name, or the CPU's for a CPU study")
    gpu_count: int | None = Field(None, description="GPUs each probe ran on (0: a CPU study)")
    host_cpu: str | None = None
    model_fingerprint: str | None = Field(None, description="a short hash of the model's parameter names and shapes "
                                          "as the probe built it (autotune.contract.provenance.model_fingerprint)")
    space_fingerprint: str | None = Field(None, description="a short hash of the study's normalized search space "
                                          "(autotune.contract.provenance.space_fingerprint)")
    source_trial: int | None = Field(None, description="the trial whose run the environment fields are read from")
    baseline_trial: int | None = Field(None, description="the baseline run the verdict's last comparison names "
                                       "(its environment is checked against the source's: `mixed`)")
    mixed: list[str] = Field(default_factory=list, description="what the pick's and the baseline's runs disagree on "
                             "(torch, CUDA or driver version, GPU, GPU count, model): empty when they agree")


class CheckInputs(BaseModel):
    """What `autotune check` needs to measure a certified pick against its baseline again on
    another host, as the study's verdict did: the baseline's config, the judged probe budget
    and the decision rule's settings."""

    baseline_config: dict[str, Any] = Field(default_factory=dict, description="the baseline's knobs as it ran")
    samples: int | None = Field(None, description="training samples of each judged run (None: the preset's)")
    windows: int = 8
    warmup_steps: int = 5
    seed: int = Field(1000, description="the first probe seed of the re-measure rounds")
    abs_tol: float = 0.01
    k: float = 2.0
    quality_margin: float | None = Field(None, description="the non-inferiority margin the study judged the pick "
                                         "with (max(abs_tol, k × the baseline's seed spread over all its runs)): "
                                         "a check's few baseline runs never narrow it")
    confidence: float = 0.95
    hardware: str = "cpu"
    gpus_per_trial: int = 1


class Recommendation(BaseModel):
    study: str
    config: dict[str, Any]
    trial_number: int
    throughput_samples_per_s: float
    val_nrmse: float | None = Field(None, description="quality when the metric is val_nrmse (ups); else None")
    baseline_throughput_samples_per_s: float | None
    baseline_val_nrmse: float | None = None
    speedup: float | None
    gate_nrmse: float | None = None
    quality_metric: str = Field("val_nrmse", description="the name of the study's quality metric")
    quality_direction: Literal["minimize", "maximize"] = "minimize"
    quality: float | None = Field(None, description="the recommended config's quality metric")
    baseline_quality: float | None = Field(None, description="the mean of the baseline seeds' quality metric")
    baseline_quality_std: float | None = None
    gate_quality: float | None = Field(None, description="the gate: the worst quality a feasible trial may have")
    peak_mem_reserved_bytes: int | None = None
    throughput_ci_low: float | None = Field(None, description="95 % confidence interval of the throughput")
    throughput_ci_high: float | None = None
    remeasured: bool = False
    remeasure_rounds: int = Field(0, description="the re-measurements the throughput pools (0: the search trial's own)")
    round_throughputs: list[float] = Field(default_factory=list, description="each re-measurement's own throughput, "
                                           "round by round (empty: not re-measured): how much the config's speed "
                                           "varied from process to process")
    baseline_val_nrmse_std: float | None = None
    baseline_seeds: int = 0
    measurement_notes: list[str] = Field(default_factory=list, description="what qualifies the recommended "
                                         "throughput's measurement (e.g. the GPU was throttled during it)")
    speedup_ci_low: float | None = Field(None, description="95 % confidence interval of the speedup (the ratio), "
                                         "from the run-to-run spread of the baseline's and the pick's runs")
    speedup_ci_high: float | None = None
    beats_baseline: bool | None = Field(None, description="the speedup's interval lies above 1 (False: no config "
                                        "beat the baseline beyond the noise; None: no interval)")
    verdict: str = Field("", description="one sentence: the speedup, its interval, and whether it is beyond noise")
    quality_budget: Literal["search", "remeasure"] = Field(
        "search", description="the sample budget `quality` and `gate_quality` are at: the re-measurement's "
        "(judged against the baseline re-measured at that budget) or the search probe's")
    search_quality: float | None = Field(None, description="the pick's quality in its search trial (short probe)")
    search_gate_quality: float | None = Field(None, description="the gate at the search's sample budget (from "
                                              "the baseline seeds), which judged every search trial")
    search_throughput_samples_per_s: float | None = Field(None, description="the pick's search-trial throughput")
    caveats: list[str] = Field(default_factory=list, description="what qualifies the recommendation itself (not "
                               "re-measured, quality not judged at the re-measure budget, how the speedup's "
                               "interval was formed)")
    baseline_remeasured: bool = Field(False, description="the baseline was re-measured with the pick: the speedup "
                                      "and quality compare the two at the same budget")
    chosen_by: Literal["throughput", "energy"] = Field(
        "throughput", description="what picked the config among the candidates: the fastest (a study with a "
        "throughput objective, or with neither) or the lowest energy per sample (energy without throughput)")
    energy_j_per_sample: float | None = Field(None, description="the pick's GPU joules per sample (pooled over its "
                                              "re-measurements); None where not measured")
    baseline_energy_j_per_sample: float | None = Field(None, description="the baseline's, at the same budget as "
                                                       "the speedup's baseline")
    energy_ratio: float | None = Field(None, description="the pick's energy per sample over the baseline's "
                                       "(below 1: less energy per sample)")
    energy_ratio_ci_low: float | None = Field(None, description="95 % interval of the energy ratio, formed like the "
                                              "speedup's")
    energy_ratio_ci_high: float | None = None
    saves_energy: bool | None = Field(None, description="the energy ratio's interval lies below 1 (None: no "
                                      "interval)")
    energy_method: str | None = Field(None, description="nvml_total_energy | power_integral")
    energy_verdict: str = Field("", description="one sentence on the energy ratio (empty: not measured)")
    certified: bool = Field(False, description="the pick is faster beyond the noise and its quality no worse than "
                            "the baseline's (autotune.contract.verdict); False: `config` is the baseline's own")
    outcome: Literal["certified", "no_win", "undecided", "not_judged"] = Field(
        "not_judged", description="certified; no_win: every candidate was rejected; undecided: the re-measure budget "
        "ran out before a candidate was decided; not_judged: re-measurement is off (remeasure.top_k 0)")
    reason: str = Field("", description="why the verdict is what it is, in one sentence")
    configs: list[ConfigVerdict] = Field(default_factory=list, description="the decision rule's inputs, baseline "
                                         "first: n, mean and sd per config")
    rounds_run: int = Field(0, description="re-measure rounds run")
    max_rounds: int = Field(0, description="the most rounds the study may run (remeasure.round_limit)")
    remeasure_probes: int = Field(0, description="re-measure probes run (the verdict's cost)")
    uncertified: ConfigVerdict | None = Field(None, description="the fastest candidate that was not certified (what "
                                              "`autotune best --uncertified` prints)")
    provenance: Provenance = Field(default_factory=Provenance, description="what the verdict was measured on: "
                                   "versions, device, workload, model and search-space fingerprints")
    check: CheckInputs | None = Field(None, description="what `autotune check` re-measures a certified pick with "
                                      "(best.yaml's `# autotune-check:` line)")

    def energy_lines(self) -> list[str]:
        """The energy in words (the YAML header, the report): the pick's J/sample, the baseline's
        and their ratio with its interval; nothing when the pick has none."""
        if self.energy_j_per_sample is None:
            return []
        method = f" ({self.energy_method})" if self.energy_method else ""
        lines = [f"energy: {self.energy_j_per_sample:.4g} J/sample{method}"]
        if self.baseline_energy_j_per_sample is not None:
            same = " at the same budget" if self.baseline_remeasured else ""
            ratio = "n/a" if self.energy_ratio is None else f"{self.energy_ratio:.2f}x"
            if self.energy_ratio_ci_low is not None and self.energy_ratio_ci_high is not None:
                ratio += f", 95% CI {self.energy_ratio_ci_low:.2f}-{self.energy_ratio_ci_high:.2f}x"
            lines.append(f"baseline energy: {self.baseline_energy_j_per_sample:.4g} J/sample{same} "
                         f"(pick / baseline {ratio})")
        return lines
