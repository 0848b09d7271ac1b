"""The study commands: `autotune submit|status|stop|best|report` against a service, `autotune
tune` and `autotune demo` on this machine, and the loading of a study spec (its errors as
usage errors; a spec without `hardware` that needs a GPU is refused)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape as rich_escape

from autotune.cli.common import (
    ApiOption,
    FolderError,
    SpecFileError,
    TokenFileOption,
    TokenOption,
    err,
    make_console,
    make_folder,
    read_spec_file,
    resolve_token,
    say_error,
    service_client,
    spec_errors,
    usage_error,
)
from autotune.cli.tables import LOST_LABEL, UNNEEDED_LABEL, studies_table, trials_table, verdict_line, verdict_table
from autotune.contract.views import LOST_TO_RERUN, stopped_unneeded
from autotune.worker.client import DEFAULT_API, Conflict, NotFound

if TYPE_CHECKING:
    from autotune.contract.views import StudyInfo


# Built-in presets sized for a GPU (tens of millions of parameters, ~19 k samples a probe): as a
# CPU study each trial would take hours. The registry does not say it; these are the built-ins'.
GPU_PRESETS: dict[str, tuple[str, ...]] = {"ups": ("full", "full-muon"), "gpt": ("full",)}
# Knob values that act only on a CUDA device: a CPU probe runs them as no-ops (or cannot run them).
GPU_ONLY_VALUES: dict[str, tuple[Any, ...]] = {"precision": ("fp8", "tf32"), "compile": ("reduce-overhead",),
                                               "step_graph": (True,), "cudnn_benchmark": (True,),
                                               "pin_memory": (True,)}
GPU_NAME_EXAMPLE = "NVIDIA H100 80GB HBM3"


def _gpu_only(values: Mapping[str, Any] | None) -> list[str]:
    """'knob=value' ('knob=a/b' for several) for the GPU-only values in `values` (a config, or
    knob -> a list of choices)."""
    found = []
    for knob, value in (values or {}).items():
        hits = [json.dumps(v).strip('"') for v in (value if isinstance(value, (list, tuple)) else (value,))
                if v in GPU_ONLY_VALUES.get(knob, ())]
        if hits:
            found.append(f"{knob}={'/'.join(hits)}")
    return found


def _gpu_signs(spec: Any) -> list[str]:
    """What in a validated StudySpec says it was meant for a GPU: a built-in preset sized for one,
    GPU-only knob values in its space or baseline. Empty when nothing does."""
    signs = []
    if spec.preset in GPU_PRESETS.get(spec.workload, ()):
        signs.append(f"preset {spec.preset!r} of workload {spec.workload!r} is sized for a GPU (a CPU probe of it "
                     "takes hours)")
    space = spec.resolved_space()
    searched = _gpu_only({name: list(p.choices) for name, p in space.params.items() if p.choices is not None})
    fixed = _gpu_only(space.fixed)
    label = f"space {spec.space!r}" if isinstance(spec.space, str) else "the space"
    if searched:
        signs.append(f"{label} searches GPU-only values ({', '.join(searched)})")
    if fixed:
        signs.append(f"{label} fixes GPU-only values ({', '.join(fixed)})")
    if baseline := _gpu_only(spec.baseline):
        signs.append(f"the baseline sets GPU-only values ({', '.join(baseline)})")
    return signs


def _implicit_cpu_check(spec_file: Path, data: dict[str, Any]) -> None:
    """A spec without `hardware` is a CPU study (StudySpec's default). Refuse one whose workload
    preset or knobs need a GPU (exit 2, naming the field and both fixes); a user who means it
    on CPUs writes hardware: cpu."""
    from pydantic import ValidationError

    from autotune.contract.protocol import StudySpec

    try:  # as a GPU study: the spec's GPU intent, also where cpu rules refuse it (fp8)
        as_gpu = StudySpec.model_validate({**data, "hardware": GPU_NAME_EXAMPLE})
    except ValidationError:
        return  # invalid for another reason: the usual validation names it
    signs = _gpu_signs(as_gpu)
    if not signs:
        return
    try:
        StudySpec.model_validate({**data, "hardware": "cpu"})
        on_cpu = "write hardware: cpu to run it on CPU workers anyway"
    except ValidationError as e:
        on_cpu = f"write hardware: cpu and drop what a CPU cannot run ({spec_errors(e)})"
    raise usage_error(
        f"{spec_file}: hardware: not set, so this would be a CPU study (the default), but {'; '.join(signs)}. "
        f"Set hardware: to the GPU's name as its workers report it (`autotune worker --device cuda` prints it "
        f"as its hardware class), e.g. hardware: {GPU_NAME_EXAMPLE}; or {on_cpu}")


def _worker_command(info: StudyInfo, api: str) -> tuple[str, list[str]]:
    """A worker command line that takes the study's trials, and notes on what it needs besides:
    the device of its hardware class, its gpus_per_trial, --allow-workload for a workload that
    is not built in (NAME=module:attr where this machine knows the import path)."""
    import shlex

    from autotune.contract.registry import ENTRY_POINT_GROUP, ENV_VAR, registered_workloads

    spec = info.spec
    gpu = spec.hardware != "cpu"
    parts = ["autotune worker", f"--api {shlex.quote(api)}", f"--study {info.name}",
             f"--device {'cuda' if gpu else 'cpu'}"]
    notes = []
    if gpu:
        notes.append(f"on a host whose GPU is named {spec.hardware!r} exactly, the study's hardware")
    if spec.gpus_per_trial > 1:
        parts.append(f"--gpus-per-trial {spec.gpus_per_trial}")
        if gpu:
            notes.append(f"--device cuda splits the host's GPUs into groups of {spec.gpus_per_trial}; "
                         f"--device cuda:0,1,... picks them")
    entry = registered_workloads().get(spec.workload)
    if entry is None or not entry.builtin:
        if entry is not None and entry.source == "environment" and entry.target:
            parts.append(f"--allow-workload {spec.workload}={entry.target}")
            notes.append(f"{entry.target.partition(':')[0]} must be importable on the worker's host")
        elif entry is not None and entry.source == "environment":
            parts.append(f"--allow-workload {spec.workload}=MODULE:ATTR")
            notes.append(f"MODULE:ATTR: the import path of {spec.workload!r}'s code on the worker's host "
                         f"({ENV_VAR} names it here without one)")
        else:
            parts.append(f"--allow-workload {spec.workload}")
            notes.append(f"the worker's host needs the package that registers {spec.workload!r} under "
                         f"{ENTRY_POINT_GROUP!r}")
    return " ".join(parts), notes


def _load_spec(spec_file: Path, name: str | None, check_cpu: bool = True,
               host_hardware: Callable[[], str] | None = None) -> tuple[Any, bool]:
    """The StudySpec in `spec_file` (YAML or JSON; `name` overrides its name) and whether it
    leaves `hardware` out; a usage error naming the file and the field otherwise. With
    `host_hardware`, a spec without `hardware` takes this host's before it is validated (its
    space is checked against that GPU, not the CPU)."""
    from pydantic import ValidationError

    from autotune.contract.protocol import StudySpec

    try:
        data = read_spec_file(spec_file)
    except SpecFileError as e:
        raise usage_error(str(e)) from None
    if name is not None:
        data["name"] = name
    implicit_cpu = "hardware" not in data
    if implicit_cpu and host_hardware is not None:
        data["hardware"] = host_hardware()
    elif implicit_cpu and check_cpu:
        _implicit_cpu_check(spec_file, data)
    try:
        return StudySpec.model_validate(data), implicit_cpu
    except ValidationError as e:
        raise usage_error(f"{spec_file}: {spec_errors(e)}") from None


def tune(
    spec_file: Annotated[Path, typer.Argument(metavar="SPEC", help="Study spec: a YAML or JSON file.")],
    workdir: Annotated[Path, typer.Option(help="Work directory: the study's database, tokens and logs (run "
                                               "the command again with it to resume).")] = Path("autotune-work"),
    workers: Annotated[int | None, typer.Option(help="Workers: default one per GPU; on a CPU host 2 (they split "
                                                     "the cores).", min=1)] = None,
    out: Annotated[Path, typer.Option(help="Where to write the verdict's config (YAML).")] = Path("best.yaml"),
    allow_workload: Annotated[list[str] | None, typer.Option(
        "--allow-workload", help="A workload of your own for the workers, as for `autotune worker`: NAME, or "
                                 "NAME=module:attr (repeatable).")] = None,
    name: Annotated[str | None, typer.Option(help="Override the spec's study name.")] = None,
    port: Annotated[int, typer.Option(help="Service port (0: a free one).", min=0, max=65535)] = 0,
) -> None:
    """Tune a study on this machine in one command: an embedded service on SQLite, local
    workers (one per GPU, or CPU workers), live progress, the verdict, best.yaml.

    Ctrl-C stops cleanly; the same command again resumes the study. Python: autotune.tune(spec).
    Exit status: 0 a certified pick in best.yaml; 1 finished without one (best.yaml holds the
    baseline's config: keep it); 2 bad input; 3 the study could not finish; 130 interrupted.
    """
    from autotune.cli.local import TuneError, local_devices, run_tune

    def host_hardware() -> str:  # the host decides: its GPU, else the CPU
        try:
            return local_devices(None, workers).hardware
        except TuneError as e:
            raise usage_error(str(e)) from None

    from autotune.contract.registry import export_workload_paths, workload_paths

    try:  # NAME=module:attr workloads known before the spec that names one is validated
        export_workload_paths(workload_paths(allow_workload or []))
    except ValueError as e:
        raise usage_error(str(e)) from None
    spec, _ = _load_spec(spec_file, name, host_hardware=host_hardware)
    code, _ = run_tune(spec, workdir, workers=workers, out=out, allow_workloads=allow_workload or (), port=port)
    raise typer.Exit(code=code)


def submit(
    spec_file: Annotated[Path, typer.Argument(metavar="SPEC", help="Study spec: a YAML or JSON file.")],
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
    name: Annotated[str | None, typer.Option(help="Override the spec's study name.")] = None,
) -> None:
    """Create a study from a YAML/JSON spec (autotune.contract.protocol.StudySpec) and print it, with a
    worker command that takes its trials.

    A spec without `hardware` is a CPU study (said so); one whose preset or knobs need a GPU
    is refused until `hardware` is set.

    Exit status: 0 created, 1 service unreachable or the name is taken, 2 invalid spec.
    """
    spec, implicit_cpu = _load_spec(spec_file, name)
    with service_client(api, resolve_token(token, token_file)) as client:
        try:
            info = client.create_study(spec)
        except Conflict as e:
            say_error(e.message)
            raise typer.Exit(code=1) from None
    console = make_console()
    space = info.spec.space if isinstance(info.spec.space, str) else "inline"
    console.print(f"created study [bold]{info.name}[/] ({info.state}): {info.spec.workload}/{info.spec.preset}, "
                  f"space {space}, {info.spec.n_trials} trials, sampler {info.spec.sampler}, "
                  f"hardware {info.spec.hardware}", highlight=False, soft_wrap=True)
    for note in info.notes:
        err.print(f"[yellow]note:[/] {rich_escape(note)}", highlight=False, soft_wrap=True)
    if implicit_cpu:
        err.print("[yellow]note:[/] no `hardware` in the spec: this is a CPU study; workers with GPUs will not take "
                  "it. For a GPU study set hardware: <the GPU's name as workers report it> (e.g. "
                  f"hardware: {GPU_NAME_EXAMPLE}; `autotune worker --device cuda` prints it as its hardware class)",
                  highlight=False, soft_wrap=True)
    command, notes = _worker_command(info, api)
    console.print(f"start workers: {command}", markup=False, highlight=False, soft_wrap=True)
    for note in notes:
        console.print(f"               ({note})", markup=False, highlight=False, soft_wrap=True)
    console.print(f"watch it:      autotune status {info.name} --api {api}", markup=False, highlight=False,
                  soft_wrap=True)


def status(
    study: Annotated[str | None, typer.Argument(help="A study name (default: list the studies).")] = None,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
) -> None:
    """Show the studies, or one study's trials (state, throughput, NRMSE, feasibility, failure, params)."""
    console = make_console()
    with service_client(api, resolve_token(token, token_file)) as client:
        if study is None:
            studies = client.list_studies().data
            if not studies:
                console.print("no studies yet: create one with `autotune submit SPEC.yaml`")
                return
            console.print(studies_table(studies))
            return
        info = client.get_study(study)
        trials = client.trials(study).data
    # the baseline seeds and search trials count against n_trials; the verdict's re-measurements come on top
    searched = [t for t in trials if t.role != "remeasure" and t.retried_as is None]
    by_state = Counter(LOST_LABEL if t.to_rerun else t.state.lower() for t in searched)
    counts = ", ".join(f"{n} {state}" for state, n in sorted(by_state.items())) or "no trials yet"
    remeasured = [t for t in trials if t.role == "remeasure" and t.retried_as is None]
    unneeded = sum(t.state == "PRUNED" and stopped_unneeded(t.prune_reason) for t in remeasured)
    rounds = (f" · {len(remeasured)} re-measure run(s)" + (f", {unneeded} {UNNEEDED_LABEL}" if unneeded else "")
              if remeasured else "")
    console.print(f"study [bold]{info.name}[/]: {info.state} · {len(searched)} of {info.spec.n_trials} trials "
                  f"({counts}){rounds} · hardware {info.spec.hardware}", highlight=False, soft_wrap=True)
    if info.message:
        console.print(f"[yellow]{rich_escape(info.message)}[/]", highlight=False, soft_wrap=True)
    for note in info.notes:
        console.print(f"[yellow]note:[/] {rich_escape(note)}", highlight=False, soft_wrap=True)
    warm = Counter(t.warm_start_from for t in searched if t.warm_start_from)
    if warm:
        console.print("warm start: " + ", ".join(f"{n} config(s) from {name}" for name, n in warm.items())
                      + " tried first (measured again here)", highlight=False, soft_wrap=True)
    elif info.spec.warm_start != "none":
        warm_start = info.spec.warm_start
        named = warm_start if isinstance(warm_start, str) else ", ".join(warm_start)
        console.print(f"warm start ({named}): no earlier config tried (resolved once, when the search starts)",
                      highlight=False)
    if info.failures:
        console.print("failures: " + ", ".join(f"{n} {kind}" for kind, n in sorted(info.failures.items())),
                      highlight=False)
    console.print(trials_table(trials, f"trials of {info.name}"))
    console.print(verdict_line(info), highlight=False, soft_wrap=True)
    if info.best and info.best.get("configs"):
        console.print(verdict_table(_recommendation(info.best)))


def stop(
    study: Annotated[str, typer.Argument(help="The study to stop.")],
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
) -> None:
    """Stop a study: no more trials are leased, running probes are told to stop at their next
    heartbeat, and everything measured is kept (`autotune status` and `autotune best` still
    answer). Needs an admin token where the service has auth. Stopping a stopped study changes
    nothing."""
    with service_client(api, resolve_token(token, token_file)) as client:
        info = client.stop_study(study)
    done = sum(n for state, n in info.counts.items() if state not in ("RUNNING", LOST_TO_RERUN))
    running = info.counts.get("RUNNING", 0)
    print(f"study {info.name}: {info.state} · {done} trial(s) finished"
          + (f", {running} running told to stop at their next heartbeat" if running else "")
          + "; its data is kept (`autotune status`, `autotune best`)")


def best(
    study: Annotated[str, typer.Argument(help="The study's name.")],
    output_format: Annotated[str, typer.Option("--format", help="yaml (a config file `autotune probe --config` "
                                                                "reads) or json.")] = "yaml",
    uncertified: Annotated[bool, typer.Option("--uncertified", help="Print the fastest candidate that was NOT "
                                              "certified (labelled so) instead of the verdict's config.")] = False,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
) -> None:
    """Print the study's verdict: the certified pick's config, else the baseline's own.

    A pick is certified when it is faster than the baseline beyond the noise and its quality is
    no worse (docs/measurement.md, *The verdict*). Without one the YAML holds the baseline's
    config under a header that says why, never a slower config; `--uncertified` prints the
    fastest uncertified candidate for those who want it.

    Exit status: 0 a certified pick was printed; 1 no certified pick (the study found none, has
    no verdict yet, or --uncertified printed an uncertified config), or the service is
    unreachable; 2 bad input (an unknown option value or study).
    """
    from autotune.contract.recommendation import recommendation_yaml, uncertified_yaml

    if output_format not in ("yaml", "json"):
        raise usage_error(f"--format: {output_format!r} is not allowed; allowed: yaml | json")
    with service_client(api, resolve_token(token, token_file)) as client:
        try:
            rec = client.best(study)
        except NotFound as e:
            say_error(e.message)
            raise typer.Exit(code=2 if "no study named" in e.message else 1) from None
    if uncertified:
        if output_format == "json":
            row = rec.uncertified.model_dump(mode="json") if rec.uncertified else None
            sys.stdout.write(json.dumps({"study": rec.study, "certified": False, "uncertified": row}, indent=2) + "\n")
        else:
            sys.stdout.write(uncertified_yaml(rec))
        err.print(f"[yellow]uncertified:[/] {rich_escape(rec.uncertified.reason) if rec.uncertified else 'none'}",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(code=1)
    if output_format == "yaml":
        sys.stdout.write(recommendation_yaml(rec))
    else:
        sys.stdout.write(json.dumps(rec.model_dump(mode="json"), indent=2) + "\n")
    if not rec.certified:
        err.print(f"[yellow]no certified pick ({rec.outcome}):[/] {rich_escape(rec.reason)}; the config printed is "
                  "the baseline's own", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1)


def report(
    study: Annotated[str, typer.Argument(help="The study's name.")],
    out: Annotated[Path, typer.Option("--out", help="Directory for report.html and the PNG figures.")] = Path(
        "autotune-report"),
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
) -> None:
    """Write report.html with PNGs: Pareto front, best-so-far speedup, importances, failures.

    Exit status: 0 written, 1 no such study (or the service is unreachable).
    """
    from autotune.cli.report import write_report

    try:  # before the service is asked: a report that cannot be written is bad input
        out = make_folder(out, "--out")
    except FolderError as e:
        raise usage_error(str(e)) from None
    with service_client(api, resolve_token(token, token_file)) as client:
        try:
            info = client.get_study(study)
            trials = client.trials(study).data
            front = client.pareto(study).data  # the service's front: one definition everywhere
        except NotFound as e:
            say_error(e.message)
            raise typer.Exit(code=1) from None
        try:
            recommendation = client.best(study)
        except NotFound:
            recommendation = None  # nothing passes the gate yet: the report says so
    files = write_report(info, trials, recommendation, out, front)
    console = make_console()
    console.print(files.headline, highlight=False, markup=False, soft_wrap=True)
    left = f" ({', '.join(f'{name}.png' for name in files.left_out)} left out: see the page)" if files.left_out else ""
    console.print(f"wrote {files.html} and {len(files.figures)} figures{left}", highlight=False)


def demo(
    workdir: Annotated[Path, typer.Option(help="Work directory: database and logs.")] = Path("demo-work"),
    trials: Annotated[int, typer.Option(help="Trials in the demo study.", min=2)] = 12,
    workers: Annotated[int, typer.Option(help="Worker processes (CPU).", min=1)] = 2,
    port: Annotated[int, typer.Option(help="Service port (0: a free one).", min=0, max=65535)] = 0,
    samples: Annotated[int | None, typer.Option(
        help="Training samples per probe (default: the tiny preset's 3072; at least 832, what the space's "
             "largest batch needs): fewer for a quicker demo.", min=1)] = None,
) -> None:
    """Run the whole system on this machine (no GPU needed): service, a CPU study, workers.

    Prints the Pareto front, the recommended config and how to open the Optuna dashboard.
    Exit status 0 when the study finished with completed trials.
    """
    from autotune.cli.demo import run_demo

    try:
        code = run_demo(workdir, trials=trials, workers=workers, port=port, samples=samples)
    except FolderError as e:
        raise usage_error(str(e)) from None
    except ValueError as e:
        raise usage_error(f"--samples: {e}") from None
    raise typer.Exit(code=code)


def _recommendation(best: Mapping[str, Any]) -> Any:
    from autotune.contract.views import Recommendation

    return Recommendation.model_validate(best)
