"""`autotune tune SPEC`: one command that tunes on one machine, and `autotune.tune(spec)`.

It runs what a cluster runs, on this host: the service on a SQLite file in the work
directory (with its own tokens, kept there 0600), one worker per GPU (`--device cuda:N`;
on a CPU host `workers` CPU workers splitting the cores), a live progress view (trials done
of the budget, where the verdict stands), then the verdict, and best.yaml written.

Ctrl-C (or SIGTERM) stops the workers (their running trials are failed as interrupted, to be
re-run) and the service; running the same command again resumes the study: same work
directory, same database, the study found by its name. A study of that name with another
spec is refused (give another --name or --workdir).

Exit status: 0 a certified pick (best.yaml holds it); 1 the study finished without one
(best.yaml holds the baseline's config: keep it); 2 bad input (the spec, the options); 3 the
study could not finish (the service or every worker stopped: see the logs named); 130
interrupted (run it again to resume).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape as rich_escape

from autotune.cli.common import SpecFileError, make_console, make_folder, read_spec_file, say_error, spec_errors
from autotune.cli.demo import (
    DemoError,
    Processes,
    follow,
    free_port,
    report,
    sigterm_as_interrupt,
    wait_for_health,
    worker_threads,
)
from autotune.contract.protocol import StudySpec
from autotune.contract.views import Recommendation
from autotune.worker.client import ApiError, Client, NotFound, ServiceUnavailable
from autotune.worker.hardware import surely_no_gpu

CERTIFIED, KEEP_BASELINE, BAD_INPUT, DID_NOT_FINISH, INTERRUPTED = 0, 1, 2, 3, 130


class TuneError(Exception):
    """The tuning run could not be done as asked; `code` is its exit status."""

    def __init__(self, message: str, code: int = BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Devices:
    """Where the local workers run: `devices` (one worker each) and the study's hardware class."""

    devices: tuple[str, ...]
    hardware: str


def local_devices(spec_hardware: str | None, workers: int | None) -> Devices:
    """One worker per CUDA device when this host has any (the hardware class: its GPU's name),
    else `workers` CPU workers (default 2). A spec naming a hardware class this host does not
    have is refused (its workers would never get a trial). On a Linux host without a GPU's
    device files, torch is not imported (`surely_no_gpu`)."""
    cpu = Devices(("cpu",) * (workers or 2), "cpu")
    wants_gpu = spec_hardware not in (None, "cpu")
    no_gpu = TuneError(f"the spec's hardware is {spec_hardware!r}, and this host has no CUDA GPU: tune on a host "
                       "with that GPU, or set hardware: cpu")
    if surely_no_gpu():
        if wants_gpu:
            raise no_gpu
        return cpu
    import torch

    if not (wants_gpu or (spec_hardware is None and torch.cuda.is_available())):
        return cpu
    if not torch.cuda.is_available():
        raise no_gpu
    count = torch.cuda.device_count() if workers is None else min(workers, torch.cuda.device_count())
    name = torch.cuda.get_device_properties(0).name
    if spec_hardware is not None and spec_hardware != name:
        raise TuneError(f"the spec's hardware is {spec_hardware!r}, and this host's GPU is {name!r}: set "
                        f"hardware: {name} (a study's hardware is the GPU its numbers hold for)")
    return Devices(tuple(f"cuda:{i}" for i in range(count)), name)


def _tokens(cli: list[str], workdir: Path, db_url: str) -> tuple[str, str]:
    """The work directory's admin and worker tokens: kept in admin.token / worker.token (0600)
    and reused on a rerun; made (`autotune token create`, which also makes the tables) when absent."""
    from autotune.cli.demo import create_token

    out = []
    for role in ("admin", "worker"):
        path = workdir / f"{role}.token"
        if not path.exists():
            token = create_token(cli, db_url, role, f"tune-{role}-{os.getpid()}")
            path.touch(mode=0o600)
            path.write_text(token + "\n")
        out.append(path.read_text().strip())
    return out[0], out[1]


def _same_spec(stored: StudySpec, given: StudySpec) -> bool:
    return stored.model_dump(mode="json") == given.model_dump(mode="json")


def run_tune(spec: StudySpec, workdir: Path, *, workers: int | None = None, out: Path | None = Path("best.yaml"),
             allow_workloads: Sequence[str] = (), port: int = 0, console: Console | None = None,
             idle_exit_s: float = 30.0) -> tuple[int, Recommendation | None]:
    """Tune `spec` on this machine (see the module docstring); (exit status, the verdict or None)."""
    from autotune.contract.registry import parse_workload_option

    console = console or make_console(highlight=False, soft_wrap=True)
    try:  # bad input, said before anything starts
        names = [parse_workload_option(option)[0] for option in allow_workloads]
        devices = local_devices(spec.hardware if "hardware" in spec.model_fields_set else None, workers)
        workdir = make_folder(workdir, "--workdir")
        if out is not None:  # written at the end: a path that cannot take it is said now, not after the study
            if out.is_dir():
                raise TuneError(f"--out {out} is a directory: name the file to write, e.g. {out / 'best.yaml'}")
            make_folder(out.parent, "--out's folder")
    except (TuneError, ValueError) as e:
        say_error(str(e), console)
        return e.code if isinstance(e, TuneError) else BAD_INPUT, None
    if spec.hardware != devices.hardware:
        spec = spec.model_copy(update={"hardware": devices.hardware})
    db_path = workdir / "autotune.db"
    db_url = f"sqlite:///{db_path}"
    port = port or free_port()
    api = f"http://127.0.0.1:{port}"
    cli = [sys.executable, "-m", "autotune.cli"]
    processes = Processes()
    client: Client | None = None
    started = time.monotonic()
    service_env = {"AUTOTUNE_AUTH": "true", **({"AUTOTUNE_WORKLOADS": ",".join(names)} if names else {})}
    try:
        with sigterm_as_interrupt():
            console.print(f"[bold]autotune tune[/] {spec.name} in {workdir}")
            admin, worker_token = _tokens(cli, workdir, db_url)
            client = Client(api, admin, retry_for_s=10.0)
            serve_log = workdir / "serve.log"
            serve = processes.start("service", [*cli, "serve", "--db", db_url, "--port", str(port)], serve_log,
                                    env=service_env)
            problem = wait_for_health(client, serve, serve_log)
            if problem:
                raise TuneError(problem, DID_NOT_FINISH)
            try:
                info = client.get_study(spec.name)
            except NotFound:
                info = client.create_study(spec)
                console.print(f"study     {spec.name}: created ({spec.workload}/{spec.preset}, {spec.n_trials} trials, "
                              f"sampler {spec.sampler}, hardware {spec.hardware})")
            else:
                if not _same_spec(info.spec, spec):
                    raise TuneError(f"{db_path} holds a study {spec.name!r} with another spec: give this one another "
                                    "name (--name) or another --workdir, or run the same spec again to resume")
                console.print(f"study     {spec.name}: resumed ({info.state})")
            for note in info.notes:
                console.print(f"[yellow]note:[/]      {rich_escape(note)}", highlight=False, soft_wrap=True)
            if info.state == "running":
                threads = worker_threads(len(devices.devices))
                worker_procs = []
                for i, device in enumerate(devices.devices):
                    argv = [*cli, "worker", "--api", api, "--study", spec.name, "--device", device, "--idle-exit",
                            str(idle_exit_s), *(["--threads", str(threads)] if device == "cpu" else [])]
                    for option in allow_workloads:
                        argv += ["--allow-workload", option]
                    worker_procs.append(processes.start(f"worker-{i + 1}", argv, workdir / f"worker-{i + 1}.log",
                                                        env={"AUTOTUNE_TOKEN": worker_token}))
                console.print(f"workers   {len(worker_procs)} on {', '.join(devices.devices)} (logs worker-N.log)")
                finished = follow(client, spec.name, spec.n_trials, worker_procs, serve, console)
                if finished is None:
                    raise TuneError(f"the study did not finish; see {workdir}/serve.log and worker-N.log",
                                    DID_NOT_FINISH)
                info = finished
            report(client, info, db_path, time.monotonic() - started, console)
            try:
                verdict = client.best(spec.name)
            except NotFound as e:
                raise TuneError(f"no verdict: {e.message}", DID_NOT_FINISH) from None
            if out is not None:
                out.write_text(client.best_yaml(spec.name))
                what = "the certified pick" if verdict.certified else "the baseline's config (keep it)"
                console.print(f"wrote     {out} ({what}); apply it with autotune.apply(\"{out}\", model, ...)")
            return (CERTIFIED if verdict.certified else KEEP_BASELINE), verdict
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: the workers and the service are stopped; run the same command again "
                      "to resume[/]")
        return INTERRUPTED, None
    except TuneError as e:
        say_error(str(e), console)
        return e.code, None
    except ServiceUnavailable as e:
        say_error(f"{e}; see {workdir / 'serve.log'}", console)
        return DID_NOT_FINISH, None
    except (DemoError, ApiError) as e:
        say_error(str(e), console)
        return BAD_INPUT if isinstance(e, ApiError) and e.status_code == 422 else DID_NOT_FINISH, None
    finally:
        if client is not None:
            client.close()
        processes.stop_all()


def _study_spec(spec: StudySpec | dict[str, Any] | str | Path, workers: int | None) -> StudySpec:
    """`tune`'s spec as a StudySpec; TuneError (bad input) naming the file and the field. A spec
    without `hardware` takes this host's before its space is checked against it."""
    from pydantic import ValidationError

    if isinstance(spec, StudySpec):
        return spec
    where = "the spec"
    if isinstance(spec, (str, Path)):
        where = str(spec)
        try:
            spec = read_spec_file(Path(spec))
        except SpecFileError as e:
            raise TuneError(str(e)) from None
    if not isinstance(spec, dict):
        raise TuneError(f"the spec is a {type(spec).__name__}: give a StudySpec, a dict of its fields or a YAML/JSON "
                        "file's path")
    if "hardware" not in spec:
        spec = {**spec, "hardware": local_devices(None, workers).hardware}
    try:
        return StudySpec.model_validate(spec)
    except ValidationError as e:
        raise TuneError(f"{where}: {spec_errors(e)}") from None


def tune(spec: StudySpec | dict[str, Any] | str | Path, *, workdir: str | Path = "autotune-work",
         workers: int | None = None, out: str | Path | None = "best.yaml",
         allow_workloads: Sequence[str] = ()) -> Recommendation:
    """Tune a study on this machine (`autotune tune`): `spec` a StudySpec, its dict, or a YAML/JSON
    file. Returns the verdict (`Recommendation`: `.certified`, `.config`, `.speedup`, ...);
    raises TuneError when the study could not finish, or with `code` 2 (bad input) naming the
    file and the field when the spec is not a valid one; KeyboardInterrupt when interrupted
    (calling it again resumes)."""
    spec = _study_spec(spec, workers)
    code, verdict = run_tune(spec, Path(workdir), workers=workers, out=None if out is None else Path(out),
                             allow_workloads=allow_workloads)
    if code == INTERRUPTED:
        raise KeyboardInterrupt
    if verdict is None:
        if code == BAD_INPUT:
            raise TuneError(f"tuning {spec.name} was refused (bad input, said above)", code)
        raise TuneError(f"tuning {spec.name} did not finish (exit status {code}); see {workdir}", code)
    return verdict
