"""`autotune spool list|deliver|clear`: the worker's spool, results the service has not taken
yet (files on this host: list and clear need no service)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape as rich_escape
from rich.table import Table

from autotune.cli.common import (
    CLI_RETRY_S,
    ApiOption,
    TokenFileOption,
    TokenOption,
    err,
    make_console,
    resolve_token,
    service_client,
    usage_error,
)
from autotune.worker.client import DEFAULT_API

if TYPE_CHECKING:
    from autotune.worker.spool import Kept, Spool, SpoolEntry


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
    console = make_console(highlight=False, soft_wrap=True)
    if not rows:
        missing = "" if spool.root.is_dir() else " (no such folder: is it the worker's --spool-dir?)"
        console.print(f"no results in the spool {rich_escape(str(spool.root))}{missing}")
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
    console = make_console(highlight=False, soft_wrap=True)
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
    console = make_console(highlight=False, soft_wrap=True)
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
