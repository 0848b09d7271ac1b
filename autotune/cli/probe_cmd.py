"""`autotune probe`: train one configuration in this process and print the result
(a table, or one JSON object) with live progress on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from autotune.cli.common import err, make_console, usage_error
from autotune.contract.config import KNOBS, ConfigError, load_config_arg, parse_config
from autotune.contract.protocol import ProbeSpec
from autotune.contract.registry import BUILTIN
from autotune.engine.compile_workers import summary as compile_workers_summary
from autotune.engine.stdout_guard import stdout_to_stderr

PROBE_DEFAULTS = ProbeSpec()  # a study's probe defaults are `autotune probe`'s


def _format_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def print_probe_result(result: Any, console: Console) -> None:
    table = Table(title=f"probe: {result.workload}/{result.preset} on {result.device}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    if result.failure:
        table.add_row("failure", f"[red]{result.failure['kind']}[/]: {result.failure['message']}")
    rows = [
        ("throughput", "-" if result.throughput_samples_per_s is None else
         f"{result.throughput_samples_per_s:,.1f} samples/s (spread {result.throughput_spread:.1%}, "
         f"{len(result.window_throughputs)} windows × {result.window_steps} steps)"),
        (result.quality_metric, "-" if result.quality is None else f"{result.quality:.4f}"),
        ("warm-up", "-" if result.warmup_s is None else f"{result.warmup_s:.2f} s ({result.warmup_steps} steps)"),
        ("compile workers", compile_workers_summary(result.compile_workers)),
        ("setup", "-" if result.setup_s is None else f"{result.setup_s:.2f} s"),
        ("data wait", "-" if result.data_wait_fraction is None else f"{result.data_wait_fraction:.1%}"),
        ("GPU", _gpu_summary(result.window_gpu)),
        ("host", _host_summary(result.window_host, result.host_cpu)),
        ("epoch starts", _epoch_summary(result)),
        ("peak memory", f"{_format_bytes(result.peak_mem_reserved_bytes)} reserved, "
                        f"{_format_bytes(result.peak_mem_allocated_bytes)} allocated"),
        ("samples", f"{result.samples_trained} in {result.steps} steps (effective batch "
                    f"{result.config['effective_batch']})"),
        ("torch", result.torch_version),
    ]
    for name, value in rows:
        table.add_row(name, value)
    for knob, note in result.knobs.items():
        table.add_row(f"  {knob}", note)
    for note in result.measurement_notes:
        table.add_row("[yellow]note[/]", note)
    console.print(table)


def _gpu_summary(windows: list[dict[str, Any]]) -> str:
    """The timed windows' SM clock and temperature ranges and peak power ("-": no telemetry)."""
    from autotune.engine.gpu_telemetry import window_range

    def span(key: str, unit: str) -> str | None:
        got = window_range(windows, key)
        if got is None:
            return None
        low, high = got
        return f"{low:.0f}{unit}" if low == high else f"{low:.0f}–{high:.0f}{unit}"

    parts = [p for p in (span("sm_clock_mhz", " MHz SM"), span("temperature_c", " °C"), span("power_w", " W"),
                         span("utilization_percent", " % busy")) if p]
    return ", ".join(parts) or "-"


def _epoch_summary(result: Any) -> str:
    """The DataLoader's epoch starts the probe measured (autotune/engine/epoch_cost.py), how much of
    their stall the GPU idled where that was measured, and how the windows count them ("-":
    not recorded)."""
    from autotune.engine.epoch_cost import Boundary, gpu_idle_summary

    epoch = result.epoch_micro_batches
    if epoch is None:
        return "-"
    starts = result.epoch_boundaries
    if not starts:
        return f"none (an epoch is {epoch} micro-batches)"
    timed = sum(b.get("window") is not None for b in starts)
    idle = gpu_idle_summary([Boundary(b["micro_batch"], b["stall_s"], b.get("gpu_gap_s")) for b in starts])
    return (f"{len(starts)} ({timed} in the windows), {result.epoch_cost_s * 1e3:.0f} ms each"
            f"{f' ({idle})' if idle else ''}; counted once per {epoch} micro-batches")


def _host_summary(windows: list[dict[str, Any]], cpu: str | None) -> str:
    """The training loop's thread over the timed windows (autotune.engine.host_telemetry): its busy
    range, page faults, preemptions and sleeps in all; the whole host's busy range; and the
    host's CPU ("-": nothing recorded)."""
    from autotune.engine.gpu_telemetry import window_range

    parts = []
    busy = window_range(windows, "busy_fraction")
    if busy is not None:
        parts.append(f"loop thread busy {busy[0]:.0%}" + ("" if busy[0] == busy[1] else f"–{busy[1]:.0%}"))
        parts += [f"{sum(w.get(key) or 0 for w in windows):,} {label}"
                  for key, label in (("minor_faults", "page faults"), ("involuntary_switches", "preemptions"),
                                     ("voluntary_switches", "sleeps"))]
    host = window_range(windows, "host_busy_fraction")
    if host is not None:
        parts.append(f"host CPUs busy {host[0]:.0%}" + ("" if host[0] == host[1] else f"–{host[1]:.0%}"))
    if cpu:
        parts.append(cpu)
    return ", ".join(parts) or "-"


PRESETS_HELP = "; ".join(f"{e.name}: {' | '.join(e.presets or ())}" for e in BUILTIN.values())


def probe(
    workload: Annotated[str, typer.Option(help="Workload name.")] = "ups",
    preset: Annotated[str, typer.Option(help=f"Workload preset ({PRESETS_HELP}).")] = "tiny",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    config: Annotated[str, typer.Option(help="Knob values: inline JSON or a path to a YAML/JSON file.")] = "{}",
    samples: Annotated[int | None, typer.Option(help="Training samples (default: the preset's).", min=1)] = None,
    seed: Annotated[int, typer.Option(help="Seed for weights and sample order.")] = PROBE_DEFAULTS.seed,
    windows: Annotated[int, typer.Option(help="Timed windows (>= 5).", min=5)] = PROBE_DEFAULTS.windows,
    warmup_steps: Annotated[int, typer.Option(help="Warm-up optimizer steps, excluded from timing.",
                                              min=1)] = PROBE_DEFAULTS.warmup_steps,
    timeout: Annotated[float | None, typer.Option(help="Soft time limit in seconds.", min=0.1)] = None,
    trace: Annotated[Path | None, typer.Option(help="Write a Chrome trace (torch.profiler; chrome://tracing or "
                                               "Perfetto) of the warm-up's last steps, at most half of them: where "
                                               "the host's and the GPU's time goes in a step. The timed windows "
                                               "are not traced.")] = None,
    trace_steps: Annotated[int, typer.Option(help="Steps to trace (more: raise --warmup-steps too).", min=1)] = 5,
    keep_compile_workers: Annotated[bool, typer.Option(
        "--keep-compile-workers", help="Leave TorchInductor's compile pool to TorchInductor: started at the first "
                                       "compile and its idle workers running beside the timed windows (by default "
                                       "a compiling GPU probe starts it at setup and stops the workers after the "
                                       "warm-up, as TorchInductor itself stops them after a minute idle).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout (whatever the "
                                                         "workload prints goes to stderr).")] = False,
    list_knobs: Annotated[bool, typer.Option("--list-knobs", help="List the knobs and their allowed values.")] = False,
) -> None:
    """Train one configuration for a fixed sample budget and measure throughput and quality.

    Exit status: 0 when the probe succeeded, 1 when it ended in a recorded failure
    (oom, nan, timeout, unsupported, error; the result is still printed), 2 for bad input.

    stdout holds the result alone (the table, or with --json one JSON object): whatever the
    workload prints while the probe runs, its DataLoader workers included, goes to stderr.
    """
    if list_knobs:
        if not sys.stdout.isatty():  # piped: plain lines, never truncated to a terminal width
            for k in KNOBS.values():
                print(f"{k.name}\tdefault={json.dumps(k.default)}\tallowed={k.allowed()}\t{k.doc}")
            return
        table = Table("knob", "default", "allowed", "what")
        for k in KNOBS.values():
            table.add_row(k.name, json.dumps(k.default), k.allowed(), k.doc)
        make_console().print(table)
        return
    from autotune.contract.registry import UnknownWorkloadError
    from autotune.engine.probe import ProbeSettings, run_probe

    try:
        cfg = parse_config(load_config_arg(config))
        if trace is not None:  # before the probe runs, not after it
            try:
                trace.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"--trace {trace}: cannot make its folder ({e.strerror or e}); name a path "
                                 "this user can write") from None
        settings = ProbeSettings(samples=samples, seed=seed, warmup_steps=warmup_steps, windows=windows,
                                 timeout_s=timeout, trace_path=str(trace) if trace else None, trace_steps=trace_steps,
                                 quiesce_compile_workers=not keep_compile_workers)
        with stdout_to_stderr(), _probe_progress() as on_progress:  # the workload's prints stay off the result
            result = run_probe(workload, cfg, preset=preset, device=device, settings=settings,
                               on_progress=on_progress)
    except ConfigError as e:
        raise usage_error(str(e)) from None
    except (UnknownWorkloadError, ValueError) as e:
        raise usage_error(str(e)) from None
    if as_json:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
    else:
        print_probe_result(result, make_console())
    if result.failure:
        raise typer.Exit(code=1)


@contextmanager
def _probe_progress() -> Iterator[Any]:
    """An on_progress for `autotune probe`, on stderr: a live line on a terminal (every window),
    one line per phase otherwise (a log, a pipe)."""
    import time

    from autotune.worker.progress import describe_progress

    started = time.monotonic()
    last: list[str] = []

    def line(progress: dict[str, Any]) -> str:
        return f"probe: {describe_progress(progress)} ({time.monotonic() - started:.0f} s)"

    if err.is_terminal:
        with err.status("probe: setup") as status:
            yield lambda phase, info: status.update(line({"phase": phase, **info}))
        return

    def print_phase(phase: str, info: dict[str, Any]) -> None:
        if phase != "window" and last != [phase]:
            last[:] = [phase]
            err.print(line({"phase": phase, **info}), highlight=False, markup=False, soft_wrap=True)

    yield print_phase
