"""`autotune worker`: pull trials from the service and run their probes on this host."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from autotune.cli.common import ApiOption, TokenFileOption, TokenOption, resolve_token, usage_error
from autotune.worker.client import DEFAULT_API


def worker(
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
    study: Annotated[str | None, typer.Option(help="Serve only this study (default: any study of this "
                                                   "hardware class).")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or cuda:N,M,... (several GPUs: split into groups "
                                             "of --gpus-per-trial, one lease loop each).")] = "cpu",
    gpus_per_trial: Annotated[int, typer.Option(help="GPUs per trial (N ranks, DDP/FSDP2 on this host; with "
                                                     "--device cpu: gloo processes). Only studies with this "
                                                     "gpus_per_trial are leased.", min=1, max=64)] = 1,
    max_trials: Annotated[int | None, typer.Option(help="Exit after this many trials (per GPU group).",
                                                   min=1)] = None,
    idle_exit: Annotated[float | None, typer.Option(help="Exit after this many seconds without work "
                                                         "(default: never).", min=0)] = None,
    worker_id: Annotated[str | None, typer.Option(help="Worker id (default: hostname-pid-device).")] = None,
    heartbeat: Annotated[float, typer.Option(help="Seconds between heartbeats while a probe runs.",
                                             min=0.1)] = 5.0,
    threads: Annotated[int | None, typer.Option(help="torch threads per probe (default: torch's; with several "
                                                     "workers on one CPU host use cores // workers).",
                                                min=1)] = None,
    allow_workload: Annotated[list[str] | None, typer.Option(
        "--allow-workload", metavar="NAME[=module:attr]",
        help="Run trials of this workload (repeatable; default: every built-in workload). NAME=module:attr "
             "also defines it: the probe children import module:attr for studies naming NAME. A trial of any "
             "other workload is refused: completed as failed (kind 'refused') without running anything.")] = None,
    spool_dir: Annotated[Path | None, typer.Option(
        help="Where results wait until the service has them (a folder per service id, one JSON file each; written "
             "before every complete, removed once delivered; results the service will not take are kept in its "
             "rejected/ folder; `autotune spool list|deliver|clear` shows, delivers, deletes them). "
             "Default: $AUTOTUNE_SPOOL_DIR, else $XDG_STATE_HOME/autotune/spool, else "
             "~/.local/state/autotune/spool.")] = None,
    warm_start: Annotated[bool, typer.Option(
        "--warm-start/--cold-start", envvar="AUTOTUNE_WARM_START",
        help="Fork each probe child from a process that has imported torch once (saves ~3 CPU-seconds of "
             "imports a trial; Linux, one GPU per trial). --cold-start runs `python -m autotune.engine.probe_child` "
             "afresh for every trial.")] = True,
) -> None:
    """Pull trials from the service and run their probes, one child process per trial.

    Exit status: 0 after --max-trials or --idle-exit; 128 + N when stopped by signal N;
    1 when the service refuses this worker (unknown study, bad token); 2 for bad input;
    3 when --idle-exit ran out while the service could not be reached.

    $AUTOTUNE_WORKER_RETRY_S: seconds one lease call or one result's delivery keeps retrying a
    service that does not answer (default 10; the result then waits in the spool).
    """
    from autotune.worker.loop import run_worker
    from autotune.worker.options import WorkerOptions

    options = WorkerOptions(api=api, token=resolve_token(token, token_file), study=study, device=device,
                            max_trials=max_trials,
                            idle_exit_s=idle_exit, worker_id=worker_id, heartbeat_s=heartbeat, threads=threads,
                            gpus_per_trial=gpus_per_trial, spool_dir=spool_dir, warm_start=warm_start,
                            allow_workloads=tuple(dict.fromkeys(allow_workload)) if allow_workload else None)
    try:
        code = run_worker(options)
    except ValueError as e:  # bad input: the device, --study, the spool (run_worker says which)
        raise usage_error(str(e)) from None
    raise typer.Exit(code=code)
