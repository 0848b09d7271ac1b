"""The `autotune` command line."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape as rich_escape
from rich.table import Table

from autotune.cli.tables import studies_table, trials_table, verdict_line, verdict_table
from autotune.contract.config import KNOBS, ConfigError, load_config_arg, parse_config
from autotune.engine.compile_workers import summary as compile_workers_summary
from autotune.engine.stdout_guard import stdout_to_stderr
from autotune.worker.client import DEFAULT_API, ApiError, Client, Conflict, Invalid, NotFound, ServiceUnavailable

if TYPE_CHECKING:
    from autotune.contract.protocol import StudyInfo
    from autotune.worker.spool import Kept, Spool, SpoolEntry

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


@app.command()
def probe(
    workload: Annotated[str, typer.Option(help="Workload name.")] = "ups",
    preset: Annotated[str, typer.Option(help="Workload preset (ups: tiny | full | tiny-muon | full-muon; gpt: "
                                             "tiny | full).")] = "tiny",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    config: Annotated[str, typer.Option(help="Knob values: inline JSON or a path to a YAML/JSON file.")] = "{}",
    samples: Annotated[int | None, typer.Option(help="Training samples (default: the preset's).", min=1)] = None,
    seed: Annotated[int, typer.Option(help="Seed for weights and sample order.")] = 0,
    windows: Annotated[int, typer.Option(help="Timed windows (>= 5).", min=5)] = 8,
    warmup_steps: Annotated[int, typer.Option(help="Warm-up optimizer steps, excluded from timing.", min=1)] = 5,
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
        Console().print(table)
        return
    from autotune.contract.registry import UnknownWorkloadError
    from autotune.engine.probe import ProbeSettings, run_probe

    try:
        cfg = parse_config(load_config_arg(config))
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
        print_probe_result(result, Console())
    if result.failure:
        raise typer.Exit(code=1)


# --- the service and its clients ------------------------------------------------------------------

ApiOption = Annotated[str, typer.Option("--api", envvar="AUTOTUNE_API",
                                        help="Base URL of the autotune service.")]
TokenOption = Annotated[str | None, typer.Option("--token", envvar="AUTOTUNE_TOKEN",
                                                 help="Bearer token for the service. Prefer the environment "
                                                      "variable AUTOTUNE_TOKEN or --token-file: a --token value "
                                                      "shows in `ps` to every user of the host.")]
TokenFileOption = Annotated[Path | None, typer.Option("--token-file", help="Read the bearer token from this file "
                                                                          "(its first line); one only you can read "
                                                                          "(chmod 600): a file of yours that group "
                                                                          "or others may access is refused.")]


@contextmanager
def _probe_progress() -> Iterator[Any]:
    """An on_progress for `autotune probe`, on stderr: a live line on a terminal (every window),
    one line per phase otherwise (a log, a pipe)."""
    import time

    from autotune.worker.loop import describe_progress

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


def check_token_file_mode(token_file: Path) -> None:
    """Refuse a token file of this user that its group or others may access (a usage error
    naming the fix): anyone on the host could read the token and act as a worker or admin.

    Only a file this user owns is judged: one owned by another account (a Kubernetes Secret
    mounted 0440 for the pod's group, a Docker secret bind-mounted from the host) is readable
    only through that sharing, and chmod 600 would lock this user out of it."""
    try:
        info = token_file.stat()
    except OSError:
        return  # reading it says why
    if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_mode & 0o077:
        raise usage_error(f"--token-file {token_file}: its group or others may access it (mode "
                          f"{stat.S_IMODE(info.st_mode):04o}), so anyone on this host could read the token; make it "
                          f"yours alone: chmod 600 {token_file}")


def resolve_token(token: str | None, token_file: Path | None) -> str | None:
    """The token of a command: --token-file's first line, else --token / AUTOTUNE_TOKEN.
    Both a file and --token: a usage error (which one was meant is not clear); so is a file
    others may read (`check_token_file_mode`)."""
    if token_file is None:
        return token
    if token is not None and "AUTOTUNE_TOKEN" not in os.environ:
        raise usage_error("give the token one way: --token-file or --token (or AUTOTUNE_TOKEN), not both")
    check_token_file_mode(token_file)
    try:
        text = token_file.read_text()
    except OSError as e:
        raise usage_error(f"--token-file {token_file}: cannot read it ({e.strerror})") from None
    lines = text.strip().splitlines()
    if not lines or not lines[0].strip():
        raise usage_error(f"--token-file {token_file}: the file is empty; write the token from "
                          "`autotune token create` into it")
    return lines[0].strip()
CLI_RETRY_S = 1.0  # a command line fails fast when the service is down


@contextmanager
def service_client(api: str, token: str | None = None) -> Iterator[Client]:
    """A client for one command; service errors become a message and an exit status
    (1: unreachable, not found, conflict; 2: the service rejected the input)."""
    client = Client(api, token, retry_for_s=CLI_RETRY_S)
    try:
        yield client
    except ServiceUnavailable as e:
        err.print(f"[bold red]error:[/] cannot reach the autotune service at {client.base_url}: start it with "
                  f"`autotune serve` (or pass --api URL / set AUTOTUNE_API)\n  ({e.cause})", highlight=False,
                  soft_wrap=True)
        raise typer.Exit(code=1) from None
    except Invalid as e:
        raise usage_error(e.message) from None
    except ApiError as e:
        err.print(f"[bold red]error:[/] {e.message}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None
    finally:
        client.close()


def spec_errors(exc: Any) -> str:
    """A pydantic ValidationError of a StudySpec as 'field: message' lines."""
    lines = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error.get("loc", ()))
        msg = str(error.get("msg", "")).removeprefix("Value error, ")
        lines.append(msg if not field or msg.startswith(field) else f"{field}: {msg}")
    return "; ".join(lines)


@app.command()
def serve(
    db: Annotated[str | None, typer.Option(help="SQLAlchemy database URL (default: AUTOTUNE_DB_URL, else "
                                                "sqlite:///./autotune.db).")] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.", min=1, max=65535)] = 8000,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="Accept writes without a token (only with a "
                                                            "loopback --host; AUTOTUNE_AUTH=false does the "
                                                            "same).")] = False,
) -> None:
    """Run the autotune service (REST API, Optuna storage, stale-lease reaper) until interrupted.

    Upgrades the database tables first (`autotune db upgrade`). Writes need bearer tokens
    (`autotune token create`) unless --no-auth. Exit status 2 when asked to serve without
    auth on a non-loopback address or on a port another process holds (checked before the
    database is touched); 1 when the database cannot be reached or migrated.
    """
    server = service(app=True).main
    try:
        with database_command():  # the database cannot be reached or migrated: a message, exit 1
            server.run_server(db, host, port, auth=False if no_auth else None)
    except server.ServeRefused as e:
        raise usage_error(str(e)) from None


# --- the database and its tokens (directly on the database, no service needed) ---------------------

DbOption = Annotated[str | None, typer.Option("--db", help="SQLAlchemy database URL (default: AUTOTUNE_DB_URL, "
                                                           "else sqlite:///./autotune.db).")]
db_app = typer.Typer(help="The service's database: Alembic migrations (`autotune serve` upgrades at start) "
                          "and consistent SQLite backups.",
                     no_args_is_help=True)
token_app = typer.Typer(help="Bearer tokens of the service (roles: worker, admin); work on the database directly.",
                        no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")


def service(app: bool = False) -> ModuleType:
    """The service's package (autotune.api, the repository's api/) with the modules its commands use: the database, its
    tokens and backups, settings and errors (`db`, `token`); with `app`, also the web
    application (`serve`: fastapi, Optuna). The one place the CLI reaches the service, on
    first use only: the core never imports it at module level, so `autotune worker` and
    `autotune probe` start without fastapi or sqlalchemy, and `autotune token create` without
    the web application (about 1 CPU-second less)."""
    import autotune.api.auth
    import autotune.api.backup
    import autotune.api.db
    import autotune.api.errors
    import autotune.api.settings

    if app:
        import autotune.api.main
    return autotune.api


def _database_url(db: str | None) -> str:
    """--db, else the service's own default (AUTOTUNE_DB_URL, else sqlite:///./autotune.db)."""
    if db is not None:
        return db
    url: str = service().settings.Settings().db_url
    return url


@contextmanager
def database_command() -> Iterator[None]:
    """Errors of a command that works on the database as a message and an exit status
    (2: bad input; 1: anything else: unreachable database, failed migration, unknown token)."""
    from sqlalchemy.exc import SQLAlchemyError

    errors = service().errors
    migration_error = service().db.MigrationError
    try:
        yield
    except errors.Invalid as e:
        raise usage_error(e.detail) from None
    except errors.ServiceError as e:
        err.print(f"[bold red]error:[/] {e.detail}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None
    except migration_error as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None
    except SQLAlchemyError as e:
        err.print(f"[bold red]error:[/] the database failed ({type(e).__name__}: {str(e).splitlines()[0]}); check "
                  "--db / AUTOTUNE_DB_URL", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None


def _revision(revision: str | None) -> str:
    return revision or "none (no autotune tables yet)"


@db_app.command("upgrade")
def db_upgrade(
    db: DbOption = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Create or migrate the autotune tables to the newest revision (Optuna's tables are left alone)."""
    db_module = service().db
    with database_command():
        before, after = db_module.upgrade_schema(_database_url(db), revision)
    change = f"already at {after}" if before == after else f"{_revision(before)} → {after}"
    Console().print(f"autotune tables: {change}", highlight=False)


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(metavar="REV", help="Target revision, e.g. 0001, or base (drops every "
                                                                "autotune table and its data).")],
    db: DbOption = None,
) -> None:
    """Migrate the autotune tables down to REV (Optuna's tables are left alone)."""
    db_module = service().db
    with database_command():
        before, after = db_module.downgrade_schema(_database_url(db), revision)
    Console().print(f"autotune tables: {_revision(before)} → {_revision(after)}", highlight=False)


@db_app.command("current")
def db_current(db: DbOption = None) -> None:
    """Print the revision of the autotune tables (and whether it is the newest)."""
    db_module = service().db
    with database_command():
        current = db_module.current_schema_revision(_database_url(db))
        head = db_module.head_revision()
    note = " (head)" if current == head else f" (newest: {head}; run `autotune db upgrade`)"
    Console().print(_revision(current) + note, highlight=False)


@db_app.command("backup")
def db_backup(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="The copy's file (its folders are created).")],
    db: DbOption = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
) -> None:
    """Copy a SQLite database to OUT consistently, even while the service writes to it.

    Uses SQLite's online backup (a `cp` of the file misses what is still in its -wal). Exit
    status 2 for bad input (OUT exists without --force, no database file, a PostgreSQL URL:
    use pg_dump, as the message shows), 1 if SQLite fails.
    """
    backup = service().backup
    try:
        result = backup.backup_sqlite(_database_url(db), out, force=force)
    except backup.BackupRefused as e:
        raise usage_error(rich_escape(str(e))) from None
    except backup.BackupFailed as e:
        err.print(f"[bold red]error:[/] {rich_escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None
    Console().print(result.describe(), markup=False, highlight=False, soft_wrap=True)


@contextmanager
def token_store(db: str | None) -> Iterator[Any]:
    """The token table of the database (migrated first), closed afterwards."""
    store_class = service().auth.TokenStore
    with database_command():
        store = store_class.open(_database_url(db))
        try:
            yield store
        finally:
            store.close()


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option(help="worker (lease/heartbeat/report/complete) or admin (everything).")],
    name: Annotated[str | None, typer.Option(help="A unique name (default: ROLE-xxxxxx).")] = None,
    db: DbOption = None,
) -> None:
    """Create a token and print it once on stdout (only its SHA-256 is stored).

    Use it with --token or AUTOTUNE_TOKEN. Exit status 2 for a bad role or name, 1 if the
    name is taken.
    """
    with token_store(db) as store:
        secret, info = store.create(role, name)
    sys.stdout.write(secret + "\n")
    err.print(f"created {info.role} token {info.name!r} (id {info.id}); it is shown only this once: pass it "
              "with --token or AUTOTUNE_TOKEN", highlight=False, soft_wrap=True)


@token_app.command("list")
def token_list(db: DbOption = None) -> None:
    """List the tokens (never their secrets): id, name, role, created, last used, revoked."""
    with token_store(db) as store:
        tokens = store.tokens()
    if not tokens:
        Console().print("no tokens yet: create one with `autotune token create --role admin`")
        return
    table = Table("id", "name", "role", "created (UTC)", "last used (UTC)", "revoked (UTC)", title="tokens")

    def when(moment: Any) -> str:
        return "-" if moment is None else f"{moment:%Y-%m-%d %H:%M:%S}"

    for t in tokens:
        table.add_row(str(t.id), t.name, t.role, when(t.created_at), when(t.last_used_at), when(t.revoked_at))
    Console().print(table)


@token_app.command("revoke")
def token_revoke(
    name_or_id: Annotated[str, typer.Argument(metavar="NAME_OR_ID", help="The token's name or id "
                                                                         "(`autotune token list`).")],
    db: DbOption = None,
) -> None:
    """Revoke a token: the service refuses it within seconds (its row is kept). Exit status 1 if there is none."""
    with token_store(db) as store:
        info = store.revoke(name_or_id)
    Console().print(f"revoked {info.role} token {info.name!r} (id {info.id})", highlight=False)


@app.command()
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
    """
    from autotune.worker.loop import WorkerOptions, run_worker

    options = WorkerOptions(api=api, token=resolve_token(token, token_file), study=study, device=device,
                            max_trials=max_trials,
                            idle_exit_s=idle_exit, worker_id=worker_id, heartbeat_s=heartbeat, threads=threads,
                            gpus_per_trial=gpus_per_trial, spool_dir=spool_dir, warm_start=warm_start,
                            allow_workloads=tuple(dict.fromkeys(allow_workload)) if allow_workload else None)
    try:
        code = run_worker(options)
    except ValueError as e:  # the device cannot be used
        raise usage_error(str(e)) from None
    raise typer.Exit(code=code)


# --- the worker's spool (files on this host: list and clear need no service) -------------------------

spool_app = typer.Typer(help="The worker's spool: results the service has not taken yet, a folder per service "
                             "(`autotune worker --spool-dir`). list and clear work without a service.",
                        no_args_is_help=True)
app.add_typer(spool_app, name="spool")
SpoolDirOption = Annotated[Path | None, typer.Option(
    "--spool-dir", help="The spool (default, as `autotune worker`: $AUTOTUNE_SPOOL_DIR, else "
                        "$XDG_STATE_HOME/autotune/spool, else ~/.local/state/autotune/spool).")]
STATE_WORDS = {"pending": "pending", "settled": "settled (delivered; a leftover)", "rejected": "rejected"}


def _spool(spool_dir: Path | None) -> Spool:
    from autotune.worker.spool import Spool, default_spool_dir

    return Spool(spool_dir or default_spool_dir(), log_unreadable=False)  # said by the commands


def _service_of(entry: SpoolEntry) -> str:
    return f"service {entry.service_id} at {entry.api}" if entry.service_id else f"the service at {entry.api}"


def _measured(entry: SpoolEntry) -> str:
    """A result's throughput (or its failure), in words."""
    failure = entry.result.get("failure")
    if failure:
        return f"failed ({failure.get('kind', '?') if isinstance(failure, dict) else failure})"
    x = entry.result.get("throughput_samples_per_s")
    return f"{x:,.1f} samples/s" if isinstance(x, (int, float)) else "-"


def _when(moment: str | None) -> str:
    return "-" if not moment else moment.replace("T", " ").removesuffix("+00:00")


def _state(row: Kept) -> str:
    if row.state != "rejected":
        return STATE_WORDS[row.state]
    return f"rejected {_when(row.entry.rejected_at)}: {row.entry.reason or 'no reason recorded'}"


def _counts(rows: list[Kept]) -> str:
    by_state: Counter[str] = Counter(r.state for r in rows)
    return ", ".join(f"{by_state[s]} {s}" for s in STATE_WORDS if by_state[s]) or "none"


@spool_app.command("list")
def spool_list(
    spool_dir: SpoolDirOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per result and line, instead of a "
                                                         "table.")] = False,
) -> None:
    """List the results in the spool, one row each; needs no service.

    A row: the service the result belongs to (its id and URL), study, trial number and id, the
    worker that measured it, its throughput, when it was kept, and its state: pending (waiting
    for its service), settled (the service has it: a leftover the next delivery removes) or
    rejected (the service will not take it; with its reason).
    """
    spool = _spool(spool_dir)
    rows = spool.inventory()
    if as_json:
        for row in rows:
            e = row.entry
            sys.stdout.write(json.dumps({
                "state": row.state, "service_id": e.service_id, "api": e.api, "study": e.study, "number": e.number,
                "trial_id": e.trial_id, "worker_id": e.worker_id,
                "throughput_samples_per_s": e.result.get("throughput_samples_per_s"),
                "failure": e.result.get("failure"), "spooled_at": e.spooled_at, "rejected_at": e.rejected_at,
                "reason": e.reason, "belongs_to": e.home, "path": str(e.path)}) + "\n")
        _say_unreadable(spool)
        return
    console = Console(highlight=False, soft_wrap=True)
    if not rows:
        console.print(f"no results in the spool {rich_escape(str(spool.root))}")
    else:
        table = Table("service", "study", "trial", "worker", "throughput", "kept (UTC)", "state",
                      title=f"spool {rich_escape(str(spool.root))}")
        for row in rows:
            e = row.entry
            table.add_row(rich_escape(f"{e.service_id or 'unknown id'}\n{e.api}"), rich_escape(e.study),
                          f"{e.number} (id {e.trial_id})", rich_escape(e.worker_id), _measured(e),
                          _when(e.spooled_at), rich_escape(_state(row)))
        console.print(table)
        console.print(f"{len(rows)} result(s): {_counts(rows)}. `autotune spool deliver --api URL` hands a "
                      "service's pending results in; `autotune spool clear` deletes results")
    _say_unreadable(spool)


def _say_unreadable(spool: Spool) -> None:
    for why in spool.unreadable.values():
        err.print(f"[yellow]left alone:[/] {rich_escape(why)}", highlight=False, soft_wrap=True)


@spool_app.command("deliver")
def spool_deliver(
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
    spool_dir: SpoolDirOption = None,
) -> None:
    """Hand in the pending results of the service at --api, without a worker.

    The results of its service id (GET /v1/health; a result without one, or a service without
    one: those leased at that URL), each as the worker that measured it and under the worker's
    rules (its study must hold the trial, the lease token must be the service's; delivered
    results are removed, refused ones moved to rejected/, the others kept). Results of other
    services are left alone.

    Exit status 0 when none of this service's results is left pending; 1 when some are (the
    service could not be reached, refused the token, or does not take a result yet: each is
    said); 2 for bad input.
    """
    from autotune.worker.spool import belongs_to, deliver_entries, service_identity, spool_command

    spool = _spool(spool_dir)
    console = Console(highlight=False, soft_wrap=True)
    with service_client(api, resolve_token(token, token_file)) as client:
        current = service_identity(client, CLI_RETRY_S, interruptible=None)
        everything = spool.pending()
        mine = [e for e in everything if belongs_to(e, client.base_url, current)]
        who = f"service {current} at {client.base_url}" if current else f"the service at {client.base_url}"
        outcomes: Counter[str] = Counter()
        for entry, outcome in deliver_entries(spool, client, mine, current, CLI_RETRY_S, interruptible=None):
            outcomes[outcome.status] += 1
            what = f"{entry.label}, worker {entry.worker_id}, {_measured(entry)}"
            if outcome.status == "delivered":
                assert outcome.info is not None
                console.print(f"delivered {rich_escape(what)} → {outcome.info.state}")
            elif outcome.status == "already":
                console.print(f"delivered {rich_escape(what)}: {rich_escape(outcome.message)}")
            elif outcome.status == "rejected":
                where = f"kept in {outcome.path}" if outcome.path else "a failure record: dropped"
                console.print(f"[red]refused[/] {rich_escape(what)}: {rich_escape(outcome.message)}; "
                              f"{rich_escape(where)}")
            else:
                console.print(f"[yellow]kept[/] {rich_escape(what)}: {rich_escape(outcome.message)}")
            if outcome.status == "unreachable" or outcome.unauthorized:
                break  # no other delivery would fare better
    left = [e for e in spool.pending() if belongs_to(e, client.base_url, current)]
    others = sum(not belongs_to(e, client.base_url, current) for e in everything)
    delivered = outcomes["delivered"] + outcomes["already"]
    console.print(f"{who}: {len(mine)} pending result(s) in {rich_escape(str(spool.root))}; {delivered} delivered, "
                  f"{outcomes['rejected']} refused (kept in rejected/), {len(left)} still pending"
                  + (f"; {others} result(s) of other services left alone ({rich_escape(spool_command(spool.root))})"
                     if others else ""))
    if left:
        raise typer.Exit(code=1)


def _select_service(rows: list[Kept], service: str) -> list[Kept]:
    """The rows of --service: an id (or a unique start of one), or a URL (the results leased there)."""
    if "://" in service:
        chosen = [r for r in rows if r.entry.api == service.rstrip("/")]
        if not chosen:
            raise usage_error(f"--service {service}: no results leased at that URL in the spool "
                              "(`autotune spool list`)")
        return chosen
    ids = sorted({r.entry.service_id for r in rows if r.entry.service_id})
    matches = [i for i in ids if i == service] or [i for i in ids if i.startswith(service)]
    if len(matches) != 1:
        held = ", ".join(ids) or "none"
        why = "no results of that service" if not matches else "it starts more than one service id"
        raise usage_error(f"--service {service}: {why} in the spool (service ids held: {held}; "
                          "`autotune spool list`)")
    return [r for r in rows if r.entry.service_id == matches[0]]


@spool_app.command("clear")
def spool_clear(
    spool_dir: SpoolDirOption = None,
    service: Annotated[str | None, typer.Option(
        "--service", metavar="ID|URL", help="Delete this service's results (its id as `autotune spool list` shows "
                                            "it, or a unique start of it; or the URL they were leased at), "
                                            "pending ones included.")] = None,
    rejected: Annotated[bool, typer.Option("--rejected", help="Delete only rejected results (those the service "
                                                              "will not take), of every service or of "
                                                              "--service.")] = False,
    everything: Annotated[bool, typer.Option("--all", help="Delete the results of every service, pending ones "
                                                           "included.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete results from the spool, saying each; asks first unless --yes.

    A pending result is a measurement no service holds yet: it is deleted only with --service
    (that service's) or --all. --rejected deletes the results the services refused (with
    --service: that service's only). Without any of them, only settled leftovers go (results
    the service has already). Exit status 0; 1 when the question is answered no; 2 for bad
    input.
    """
    if service is not None and everything:
        raise usage_error("give --service ID or --all, not both")
    spool = _spool(spool_dir)
    rows = spool.inventory()
    notes: list[Path] = []
    if service is not None:
        rows = _select_service(rows, service)
        if not rejected:
            notes = spool.settled_notes({r.entry.service_id for r in rows if r.entry.service_id})
    elif everything and not rejected:
        notes = spool.settled_notes()
    if rejected:
        rows = [r for r in rows if r.state == "rejected"]
    elif service is None and not everything:
        kept = [r for r in rows if r.state != "settled"]
        rows = [r for r in rows if r.state == "settled"]
        if kept:
            err.print(f"kept {len(kept)} result(s) ({_counts(kept)}): --service ID or --all deletes pending "
                      "results, --rejected the rejected ones (`autotune spool list` shows them)",
                      highlight=False, soft_wrap=True)
    console = Console(highlight=False, soft_wrap=True)
    if not rows and not notes:
        console.print(f"nothing to delete in the spool {rich_escape(str(spool.root))}")
        return
    if rows and not yes:
        for r in rows:
            console.print(f"  {r.state} {rich_escape(r.entry.label)} of {rich_escape(_service_of(r.entry))} "
                          f"({_measured(r.entry)})")
        if not typer.confirm(f"Delete these {len(rows)} result(s) ({_counts(rows)}) from {spool.root}?"):
            err.print("nothing deleted", highlight=False)
            raise typer.Exit(code=1)
    deleted: list[Kept] = []
    for r in rows:
        if r.state == "rejected":
            spool.remove(r.entry)
            deleted.append(r)
            continue
        with spool.claim(r.entry) as held:
            if not held:
                console.print(f"  left alone: {rich_escape(r.entry.label)} (a worker is delivering it now)")
                continue
            spool.remove(r.entry)
        deleted.append(r)
    for note in notes:
        note.unlink(missing_ok=True)
    spool.prune()
    _say_unreadable(spool)
    for r in deleted:
        e = r.entry
        console.print(f"deleted {r.state} {rich_escape(e.label)} of {rich_escape(_service_of(e))} "
                      f"(worker {rich_escape(e.worker_id)}, {_measured(e)}): {rich_escape(str(e.path))}")
    console.print(f"deleted {len(deleted)} result(s) ({_counts(deleted)})"
                  + (f" and {len(notes)} settled note(s)" if notes else "") + f" from {rich_escape(str(spool.root))}")


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


def _load_spec(spec_file: Path, name: str | None, check_cpu: bool = True) -> tuple[Any, bool]:
    """The StudySpec in `spec_file` (YAML or JSON; `name` overrides its name) and whether it
    leaves `hardware` out; a usage error naming the file and the field otherwise."""
    import yaml
    from pydantic import ValidationError

    from autotune.contract.protocol import StudySpec

    if not spec_file.is_file():
        raise usage_error(f"{spec_file}: no such file; give a YAML or JSON study spec")
    try:
        data = yaml.safe_load(spec_file.read_text())
    except yaml.YAMLError as e:
        raise usage_error(f"{spec_file}: not valid YAML/JSON ({e})") from None
    if not isinstance(data, dict):
        raise usage_error(f"{spec_file}: expected a mapping of study fields (name, space, n_trials, ...)")
    if name is not None:
        data["name"] = name
    implicit_cpu = "hardware" not in data
    if implicit_cpu and check_cpu:
        _implicit_cpu_check(spec_file, data)
    try:
        return StudySpec.model_validate(data), implicit_cpu
    except ValidationError as e:
        raise usage_error(f"{spec_file}: {spec_errors(e)}") from None


@app.command()
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
    from autotune.cli.local import run_tune

    spec, _ = _load_spec(spec_file, name, check_cpu=False)  # the host decides: its GPUs, else the CPU
    code, _ = run_tune(spec, workdir, workers=workers, out=out, allow_workloads=allow_workload or (), port=port)
    raise typer.Exit(code=code)


@app.command()
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
            err.print(f"[bold red]error:[/] {e.message}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=1) from None
    console = Console()
    space = info.spec.space if isinstance(info.spec.space, str) else "inline"
    console.print(f"created study [bold]{info.name}[/] ({info.state}): {info.spec.workload}/{info.spec.preset}, "
                  f"space {space}, {info.spec.n_trials} trials, sampler {info.spec.sampler}, "
                  f"hardware {info.spec.hardware}", highlight=False, soft_wrap=True)
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


@app.command()
def status(
    study: Annotated[str | None, typer.Argument(help="A study name (default: list the studies).")] = None,
    api: ApiOption = DEFAULT_API,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
) -> None:
    """Show the studies, or one study's trials (state, throughput, NRMSE, feasibility, failure, params)."""
    console = Console()
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
    by_state = Counter(t.state for t in searched)
    counts = ", ".join(f"{n} {state.lower()}" for state, n in sorted(by_state.items())) or "no trials yet"
    remeasured = [t for t in trials if t.role == "remeasure" and t.retried_as is None]
    rounds = f" · {len(remeasured)} re-measure run(s)" if remeasured else ""
    console.print(f"study [bold]{info.name}[/]: {info.state} · {len(searched)} of {info.spec.n_trials} trials "
                  f"({counts}){rounds} · hardware {info.spec.hardware}", highlight=False, soft_wrap=True)
    if info.message:
        console.print(f"[yellow]{rich_escape(info.message)}[/]", highlight=False, soft_wrap=True)
    if info.failures:
        console.print("failures: " + ", ".join(f"{n} {kind}" for kind, n in sorted(info.failures.items())),
                      highlight=False)
    console.print(trials_table(trials, f"trials of {info.name}"))
    console.print(verdict_line(info), highlight=False, soft_wrap=True)
    if info.best and info.best.get("configs"):
        console.print(verdict_table(_recommendation(info.best)))


@app.command()
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
    done = sum(n for state, n in info.counts.items() if state != "RUNNING")
    running = info.counts.get("RUNNING", 0)
    print(f"study {info.name}: {info.state} · {done} trial(s) finished"
          + (f", {running} running told to stop at their next heartbeat" if running else "")
          + "; its data is kept (`autotune status`, `autotune best`)")


@app.command()
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
            err.print(f"[bold red]error:[/] {e.message}", highlight=False, soft_wrap=True)
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


@app.command()
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

    with service_client(api, resolve_token(token, token_file)) as client:
        try:
            info = client.get_study(study)
            trials = client.trials(study).data
            front = client.pareto(study).data  # the service's front: one definition everywhere
        except NotFound as e:
            err.print(f"[bold red]error:[/] {e.message}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=1) from None
        try:
            recommendation = client.best(study)
        except NotFound:
            recommendation = None  # nothing passes the gate yet: the report says so
    files = write_report(info, trials, recommendation, out, front)
    console = Console()
    console.print(files.headline, highlight=False, markup=False, soft_wrap=True)
    left = f" ({', '.join(f'{name}.png' for name in files.left_out)} left out: see the page)" if files.left_out else ""
    console.print(f"wrote {files.html} and {len(files.figures)} figures{left}", highlight=False)


@app.command()
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
    except ValueError as e:
        raise usage_error(f"--samples: {e}") from None
    raise typer.Exit(code=code)


def _recommendation(best: Mapping[str, Any]) -> Any:
    from autotune.contract.protocol import Recommendation

    return Recommendation.model_validate(best)


if __name__ == "__main__":
    app()
