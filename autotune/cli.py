"""The `autotune` command line."""

from __future__ import annotations

import json
import logging
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from autotune.config import KNOBS, ConfigError, load_config_arg, parse_config

app = typer.Typer(
    help="autotune: find the fastest PyTorch training configuration that keeps model quality.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)


def usage_error(message: str) -> typer.Exit:
    """Print a usage error (naming the bad input and the fix) and return exit code 2."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging on stderr.")] = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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
        (result.quality_metric, "-" if result.val_nrmse is None else f"{result.val_nrmse:.4f}"),
        ("warm-up", "-" if result.warmup_s is None else f"{result.warmup_s:.2f} s ({result.warmup_steps} steps)"),
        ("setup", "-" if result.setup_s is None else f"{result.setup_s:.2f} s"),
        ("data wait", "-" if result.data_wait_fraction is None else f"{result.data_wait_fraction:.1%}"),
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
    console.print(table)


@app.command()
def probe(
    workload: Annotated[str, typer.Option(help="Workload name.")] = "ups",
    preset: Annotated[str, typer.Option(help="Workload preset (ups: tiny | full).")] = "tiny",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    config: Annotated[str, typer.Option(help="Knob values: inline JSON or a path to a YAML/JSON file.")] = "{}",
    samples: Annotated[int | None, typer.Option(help="Training samples (default: the preset's).", min=1)] = None,
    seed: Annotated[int, typer.Option(help="Seed for weights and sample order.")] = 0,
    windows: Annotated[int, typer.Option(help="Timed windows (>= 5).", min=5)] = 8,
    warmup_steps: Annotated[int, typer.Option(help="Warm-up optimizer steps, excluded from timing.", min=1)] = 5,
    timeout: Annotated[float | None, typer.Option(help="Soft time limit in seconds.", min=0.1)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")] = False,
    list_knobs: Annotated[bool, typer.Option("--list-knobs", help="List the knobs and their allowed values.")] = False,
) -> None:
    """Train one configuration for a fixed sample budget and measure throughput and quality.

    Exit status: 0 when the probe succeeded, 1 when it ended in a recorded failure
    (oom, nan, timeout, unsupported, error; the result is still printed), 2 for bad input.
    """
    if list_knobs:
        if not sys.stdout.isatty():  # piped: plain lines, never truncated to a terminal width
            for k in KNOBS.values():
                print(f"{k.name}\tdefault={json.dumps(k.default)}\tallowed={k.allowed()}\t{k.doc}")
            return
        table = Table("knob", "default", "allowed", "what")
        for k in KNOBS.values():
            table.add_row(k.name, json.dumps(k.default), k.allowed(), k.doc)
        Console().print(table)
        return
    from autotune.probe import ProbeSettings, run_probe
    from autotune.workloads import UnknownWorkloadError

    try:
        cfg = parse_config(load_config_arg(config))
        settings = ProbeSettings(samples=samples, seed=seed, warmup_steps=warmup_steps, windows=windows,
                                 timeout_s=timeout)
        result = run_probe(workload, cfg, preset=preset, device=device, settings=settings)
    except ConfigError as e:
        raise usage_error(str(e)) from None
    except (UnknownWorkloadError, ValueError) as e:
        raise usage_error(str(e)) from None
    if as_json:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
    else:
        print_probe_result(result, Console())
    if result.failure:
        raise typer.Exit(code=1)


if __name__ == "__main__":
    app()
