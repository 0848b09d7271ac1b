"""The worker's spool: probe results the service's database does not hold yet, one JSON file each.

A probe costs minutes of a GPU; its result must not die with a network outage, a service
restarted on another database, a 5xx, or the worker itself. So the worker writes each result
here *before* it calls complete (write-ahead: temp file + fsync + rename) and removes the file
once the service has it; a worker started on the same spool delivers what it holds when the
service answers again (`autotune.worker.delivery`).

Layout (default `default_spool_dir`; ``--spool-dir DIR`` or $AUTOTUNE_SPOOL_DIR): a folder per
service identity, so that a worker reads only its own service's results::

    DIR/<service id>/trial-<id>-<hash>.json           waiting for that service (hash: service URL and
                                                      id, worker id, study, trial number, lease token)
    DIR/<service id>/rejected/trial-<id>-<hash>.json  the service will not take it; kept, with its reason
    DIR/<service id>/settled/trial-<id>-<hash>.json   empty: delivered (or refused for good) lately; a
                                                      lease of it handed out before is not run
    DIR/trial-<id>-<hash>.json, DIR/rejected/, DIR/settled/
                                                      the same for a lease of an unknown service id, and
                                                      the flat layout of older workers

Where a result goes: trial ids restart at 1 in every database, so an entry (`SpoolEntry`) goes
only to the service it was leased from and into its study (`misplaced`): the service's id must
be the entry's, the study's listing must hold the trial id as that trial number, and the
complete carries the lease's token, which the service takes only for that lease. An entry or a
service without an id (older ones) is matched by URL and study; an entry without a token only
to a lease without one. Otherwise the entry stays, said with where it belongs.

Delivery (`deliver`) is idempotent, because the service keeps the first result it is given:
200 or 409 "already completed" (this worker's): the file is removed; 409 another worker's,
reaped or ended lease: a measurement moves to rejected/ with the reason, a failure record is
dropped; 422: moved to rejected/, and the trial completed as failed (kind error) so that its
lease ends; 409 "not leased by this service", 404, 409 "another lease of trial", 401/403,
unreachable, 5xx: kept, offered again later. `deliver` notes each trial it finished in settled/
(kept SETTLED_KEEP_S), which every worker on the spool reads before it runs a lease
(`Spool.settled`). A delivery holds an exclusive flock on the entry's file (`Spool.claim`):
workers on one host may share a spool.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import time
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Literal

from autotune.contract.results import ANOTHER_LEASE
from autotune.contract.views import TrialInfo
from autotune.worker.client import (
    ApiError,
    Client,
    ClientError,
    Conflict,
    Invalid,
    NotFound,
    ServiceUnavailable,
    Unauthorized,
)

log = logging.getLogger(__name__)

SPOOL_ENV = "AUTOTUNE_SPOOL_DIR"
REJECTED = "rejected"
SETTLED = "settled"
SETTLED_KEEP_S = 3600.0  # how long a settled trial's note is kept (a lease handed out before it comes back at once)
FORMAT = 1
COMPLETE_REFUSED_RETRY_S = 10.0  # how long the failure record that ends a refused result's lease is retried
_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")  # a service id used as is
_ALREADY = re.compile(r"already completed(?: \(by worker (?P<who>'[^']*'|\"[^\"]*\")\))?")


def default_spool_dir() -> Path:
    """$AUTOTUNE_SPOOL_DIR, else $XDG_STATE_HOME/autotune/spool, else ~/.local/state/autotune/spool:
    state that must outlive the worker (not a cache that may be wiped)."""
    env = os.environ.get(SPOOL_ENV)
    if env:
        return Path(env).expanduser()
    state = os.environ.get("XDG_STATE_HOME")
    return (Path(state) if state else Path.home() / ".local" / "state") / "autotune" / "spool"


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class SpoolEntry:
    """One undelivered complete: what to send, to which service, as which worker."""

    api: str
    trial_id: int
    worker_id: str
    study: str
    number: int
    result: dict[str, Any]
    service_id: str | None = None  # the leasing service's identity (None: unknown, spooled by an older worker)
    lease_token: str | None = None  # the lease's token (None: an older worker's, or a lease of an older service)
    spooled_at: str = field(default_factory=utc_now)
    rejected_at: str | None = None
    reason: str | None = None  # rejected: why the service would not take it
    path: Path | None = field(default=None, compare=False)  # where it lies (None: not on disk)

    @property
    def filename(self) -> str:
        """One file per lease (trial of one service, study and worker, lease token): two services
        (databases) that both have a trial 1 never share a file, nor do two leases of a trial 1
        of the same name in a database and its backup. Without a token, the name of before."""
        key = f"{self.api}\n{self.worker_id}\n{self.service_id or ''}\n{self.study}\n{self.number}"
        if self.lease_token:
            key += f"\n{self.lease_token}"
        return f"trial-{self.trial_id}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"

    @property
    def label(self) -> str:
        return f"trial {self.number} of {self.study} (id {self.trial_id})"

    @property
    def home(self) -> str:
        """Where it belongs, in words: service, study, trial."""
        service = f"service {self.service_id}" if self.service_id else "the service"
        return f"{service} at {self.api}, study {self.study!r}, trial {self.number} (id {self.trial_id})"

    def is_lease(self, trial_id: int, study: str, number: int, service_id: str | None,
                 lease_token: str | None = None) -> bool:
        """Whether this is the result of that lease: same trial id, study and number, the same
        lease token (random per lease: it decides, whatever the service ids say; an entry and a
        lease without one match as before), of the same service (an unknown id on either side
        matches, see the module docstring)."""
        return (self.trial_id, self.study, self.number) == (trial_id, study, number) and \
            self.lease_token == lease_token and same_service(self.service_id, service_id)

    @property
    def measured(self) -> bool:
        """A measurement (a throughput, no failure), as opposed to a failure record."""
        return not self.result.get("failure") and isinstance(self.result.get("throughput_samples_per_s"),
                                                             (int, float))

    def to_json(self) -> str:
        data = {"format": FORMAT, **asdict(self)}
        data.pop("path")
        return json.dumps(data, indent=1, allow_nan=True) + "\n"

    @classmethod
    def read(cls, path: Path) -> SpoolEntry:
        """The entry in `path`; ValueError (naming the file) when it is not one."""
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            data.pop("format", None)
            known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "path"}
            entry = cls(**known)
            if not isinstance(entry.trial_id, int) or not isinstance(entry.result, dict):
                raise ValueError("trial_id or result missing")
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a spooled result ({e})") from None
        entry.path = path
        return entry


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _create(tmp: Path) -> IO[str]:
    """Open the new file `tmp`, making its folder first (again, should an empty folder be pruned
    by `Spool.prune` between the mkdir and the open)."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        return open(tmp, "x", encoding="utf-8")
    except FileNotFoundError:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        return open(tmp, "x", encoding="utf-8")


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader (or a crash) sees the old file or the whole new one:
    a temp file in the same directory, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with _create(tmp) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def folder_name(service_id: str) -> str:
    """The name of service `service_id`'s folder in a spool: the id itself (a UUID), or, for an
    id that is not a plain file name (or is one of the spool's own folders), a hash of it."""
    if _FOLDER_NAME.fullmatch(service_id) and service_id not in (REJECTED, SETTLED):
        return service_id
    return f"service-{hashlib.sha256(service_id.encode()).hexdigest()[:16]}"


Services = Collection[str | None] | None  # the services whose folders to read (None: the unknown one); None: all
State = Literal["pending", "settled", "rejected"]


@dataclass
class Kept:
    """One result a spool holds (`Spool.inventory`): pending (waiting for its service), settled
    (a pending file whose trial was delivered lately: a leftover the next delivery removes), or
    rejected (the service will not take it: kept with its reason)."""

    entry: SpoolEntry
    state: State


class Spool:
    """A spool directory (see the module docstring)."""

    def __init__(self, root: Path, log_unreadable: bool = True) -> None:
        self.root = Path(root)
        self.unreadable: dict[Path, str] = {}  # files that are not entries (left alone; logged once) -> why
        self.log_unreadable = log_unreadable  # False: the caller says them (`unreadable`)

    def check_writable(self) -> None:
        """Raise ValueError naming the spool when a result could not be written to it (made with
        its parents, a file written and removed): a worker says so before it leases anything."""
        probe = self.root / f".writable.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            with _create(probe):
                pass
            probe.unlink()
        except OSError as e:
            raise ValueError(f"--spool-dir {self.root}: cannot write there ({e.strerror or e}); results wait there "
                             "until the service has them: name a folder this user can write (--spool-dir or "
                             "$AUTOTUNE_SPOOL_DIR)") from None

    def folder(self, service_id: str | None) -> Path:
        """Where the results of service `service_id` lie (None: an unknown service's: the top)."""
        return self.root / folder_name(service_id) if service_id else self.root

    def path_of(self, entry: SpoolEntry) -> Path:
        """Where `entry` is written while it waits (`put`)."""
        return self.folder(entry.service_id) / entry.filename

    @property
    def rejected_dir(self) -> Path:
        """The rejected/ folder of results of an unknown service (and of the flat layout)."""
        return self.root / REJECTED

    @property
    def settled_dir(self) -> Path:
        """The settled/ folder of results of an unknown service (and of the flat layout)."""
        return self.root / SETTLED

    def service_folders(self) -> list[Path]:
        """The folders of the services this spool holds results of (or held)."""
        try:
            return sorted(p for p in self.root.iterdir()
                          if p.is_dir() and not p.name.startswith(".") and p.name not in (REJECTED, SETTLED))
        except OSError:
            return []

    def _folders(self, services: Services) -> list[Path]:
        if services is None:
            return [self.root, *self.service_folders()]
        return list(dict.fromkeys(self.folder(s) for s in services))

    def settle(self, entry: SpoolEntry) -> None:
        """Note that `entry`'s trial is finished for its worker (settled/ in the module
        docstring); notes older than SETTLED_KEEP_S are removed meanwhile. A note that cannot
        be written is logged: it only guards against running a finished trial again."""
        notes = self.folder(entry.service_id) / SETTLED
        try:
            notes.mkdir(parents=True, exist_ok=True)
            (notes / entry.filename).touch()
            cutoff = time.time() - SETTLED_KEEP_S
            for note in notes.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    if note.stat().st_mtime < cutoff:
                        note.unlink()
        except OSError as e:
            log.warning("could not note in %s that %s is finished: %s", notes, entry.label, e)

    def settled(self, api: str, worker_id: str, trial_id: int, study: str, number: int,
                service_id: str | None, lease_token: str | None = None) -> bool:
        """Whether this trial (a lease's: of that lease token, when given) was finished lately by a
        delivery from this spool."""
        cutoff = time.time() - SETTLED_KEEP_S
        for sid in dict.fromkeys((service_id, None)):  # also a result spooled while the service's id was unknown
            probe = SpoolEntry(api=api.rstrip("/"), trial_id=trial_id, worker_id=worker_id, study=study,
                               number=number, result={}, service_id=sid, lease_token=lease_token)
            for notes in dict.fromkeys((self.folder(sid) / SETTLED, self.settled_dir)):  # and an older worker's
                with contextlib.suppress(OSError):
                    if (notes / probe.filename).stat().st_mtime >= cutoff:
                        return True
        return False

    def is_settled(self, entry: SpoolEntry) -> bool:
        """Whether `entry`'s lease was finished lately by a delivery from this spool."""
        return self.settled(entry.api, entry.worker_id, entry.trial_id, entry.study, entry.number, entry.service_id,
                            entry.lease_token)

    def put(self, entry: SpoolEntry) -> Path:
        """Write `entry` into its service's folder (replacing an older file of the same lease);
        its path. Raises OSError when the directory cannot be written."""
        path = self.path_of(entry)
        write_atomically(path, entry.to_json())
        entry.path = path
        return path

    def _read_all(self, folder: Path) -> list[SpoolEntry]:
        try:
            names = sorted(p for p in folder.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
        except OSError:
            return []
        entries = []
        for path in names:
            try:
                entries.append(SpoolEntry.read(path))
            except ValueError as e:
                if path.exists() and path not in self.unreadable:  # said once, and left alone
                    self.unreadable[path] = str(e)
                    if self.log_unreadable:
                        log.warning("%s; left in place", e)
        return entries

    def pending(self, api: str | None = None, services: Services = None) -> list[SpoolEntry]:
        """The entries waiting for delivery, oldest first: those of service URL `api` if given,
        in the folders of `services` if given (None in it: the top, where an unknown service's
        and an older worker's entries lie), else in every folder."""
        entries = [e for folder in self._folders(services) for e in self._read_all(folder)]
        if api is not None:
            entries = [e for e in entries if e.api == api.rstrip("/")]
        return sorted(entries, key=lambda e: (e.spooled_at, e.trial_id))

    def rejected(self, services: Services = None) -> list[SpoolEntry]:
        """The results the services would not take (of `services` if given), oldest first."""
        entries = [e for folder in self._folders(services) for e in self._read_all(folder / REJECTED)]
        return sorted(entries, key=lambda e: (e.spooled_at, e.trial_id))

    def inventory(self, services: Services = None) -> list[Kept]:
        """Every result the spool holds (of `services` if given): pending and settled ones
        first, then the rejected ones, each oldest first."""
        rows = [Kept(e, "settled" if self.is_settled(e) else "pending") for e in self.pending(services=services)]
        return rows + [Kept(e, "rejected") for e in self.rejected(services)]

    def settled_notes(self, services: Services = None) -> list[Path]:
        """The settled/ notes (of `services` if given)."""
        notes: list[Path] = []
        for folder in self._folders(services):
            with contextlib.suppress(OSError):
                notes += sorted(p for p in (folder / SETTLED).iterdir() if p.is_file())
        return notes

    def find(self, api: str, trial_id: int, worker_id: str) -> SpoolEntry | None:
        """The oldest pending entry of this trial id, service URL and worker, if there is one
        (whatever its study: `SpoolEntry.is_lease` tells whether it is a given lease's)."""
        return next((e for e in self.pending(api) if e.trial_id == trial_id and e.worker_id == worker_id), None)

    def remove(self, entry: SpoolEntry) -> None:
        """Forget a delivered entry (harmless when another worker removed it first)."""
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)
            _fsync_dir(entry.path.parent)

    def prune(self) -> None:
        """Remove the service folders (and rejected/, settled/ folders) left empty."""
        for folder in self.service_folders():
            for sub in (folder / REJECTED, folder / SETTLED, folder):
                with contextlib.suppress(OSError):
                    sub.rmdir()  # only an empty one goes
        for sub in (self.rejected_dir, self.settled_dir):
            with contextlib.suppress(OSError):
                sub.rmdir()

    def reject(self, entry: SpoolEntry, reason: str) -> Path:
        """Move `entry` to its service's rejected/ with `reason` (written first, then the pending
        file removed: a crash in between leaves it in both places, never in neither); its new path."""
        pending = entry.path
        entry.reason, entry.rejected_at = reason, utc_now()
        target = self.folder(entry.service_id) / REJECTED / entry.filename
        if target.exists():  # an earlier rejected result of the same trial: keep both
            target = target.with_name(f"{target.stem}-{secrets.token_hex(3)}.json")
        write_atomically(target, entry.to_json())
        entry.path = target
        if pending is not None and pending != target:
            pending.unlink(missing_ok=True)
        return target

    @contextlib.contextmanager
    def claim(self, entry: SpoolEntry) -> Iterator[bool]:
        """Hold `entry`'s file for a delivery: yields False when another worker holds it (or it is
        gone), True otherwise (also for an entry that is not on disk)."""
        if entry.path is None:
            yield True
            return
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except FileNotFoundError:
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                yield False
                return
            yield entry.path.exists()  # delivered and removed by its holder just before we locked it
        finally:
            os.close(fd)


# --- delivery ------------------------------------------------------------------------------------


Status = Literal["delivered", "already", "rejected", "kept", "unreachable"]


@dataclass
class Delivery:
    """What became of one spooled result (`deliver`)."""

    status: Status
    message: str
    info: TrialInfo | None = None
    path: Path | None = None  # where the result is kept (kept, unreachable, rejected)
    unauthorized: bool = False  # the service refused the token: no other delivery will fare better


def unauthorized_hint(api: str, detail: str) -> str:
    """A 401/403 from `api`, with its likely causes and the fix."""
    return (f"the service at {api} does not accept this worker's token ({detail}). Likely causes: the service "
            "was started on another database than before (tokens live in the database; e.g. started without "
            "--db, on a new ./autotune.db), or the token was revoked. Restart the service with its --db, or "
            "create a worker token on its database: autotune token create --role worker --db URL")


def same_service(spooled: str | None, current: str | None) -> bool:
    """Whether a result spooled from service id `spooled` may go to service id `current`: the
    same id, or one of them unknown (an older worker's entry, an older service: matched by URL)."""
    return spooled is None or current is None or spooled == current


def service_identity(client: Client, retry_for_s: float | None, interruptible: bool | None = True) -> str | None:
    """The id the service at `client` shows (GET /v1/health), None when it shows none (an older
    service) or answers the health call with an error. Raises ServiceUnavailable."""
    try:
        reply = client.health(retry_for_s=retry_for_s, interruptible=interruptible)
    except (ApiError, ValueError) as e:
        log.debug("no service id from %s: %s", client.base_url, e)
        return None
    service_id = reply.get("service_id") if isinstance(reply, dict) else None
    return service_id if isinstance(service_id, str) and service_id else None


Listing = dict[int, int] | Literal["missing"] | None  # a study's trial id → number; "missing": no such study


def misplaced(client: Client, entry: SpoolEntry, service_id: str | None, retry_for_s: float | None,
              listings: dict[str, Listing] | None = None, interruptible: bool | None = True) -> Delivery | None:
    """Why `entry` must not be delivered to the service at `client` (a "kept" or "unreachable"
    Delivery), or None when it may. `service_id`: the id the service shows now. With `listings`
    (study → its trials, filled as read: one read per study and round) the study's listing must
    also hold the trial id as the entry's trial number: a spooled result may meet a copy of its
    database, where the id is the same but trial ids were handed out again. A listing the
    service answers with another error than 404 (None) is no verdict: the complete's reply decides."""
    if not same_service(entry.service_id, service_id):
        return Delivery("kept", f"it belongs to {entry.home}; the service at {client.base_url} is now service "
                                f"{service_id} (another database: restarted without its --db, or on another file). "
                                f"Delivered when service {entry.service_id} answers at {entry.api} again",
                        path=entry.path)
    if listings is None:
        return None
    if entry.study not in listings:
        try:
            trials = client.trials(entry.study, retry_for_s=retry_for_s, interruptible=interruptible)
        except ServiceUnavailable as e:
            return Delivery("unreachable", str(e), path=entry.path)
        except NotFound:
            listings[entry.study] = "missing"
        except (ApiError, ValueError) as e:
            log.debug("could not read study %s's trials from %s: %s", entry.study, client.base_url, e)
            listings[entry.study] = None
        else:
            listings[entry.study] = {t.trial_id: t.number for t in trials.data}
    listing = listings[entry.study]
    if listing is None or (listing != "missing" and listing.get(entry.trial_id) == entry.number):
        return None
    if listing == "missing":
        here = f"has no study {entry.study!r}"
    elif entry.trial_id in listing:
        here = f"has trial id {entry.trial_id} as trial {listing[entry.trial_id]} of study {entry.study!r}"
    else:
        here = f"has no trial id {entry.trial_id} in study {entry.study!r}"
    return Delivery("kept", f"it belongs to {entry.home}, and the service at {client.base_url} {here} (another "
                            "database, or a restored copy of it): not delivered there, so that it cannot land in "
                            "another trial. Delivered when the service on the trial's database answers",
                    path=entry.path)


def _reject(spool: Spool, entry: SpoolEntry, reason: str) -> Path | None:
    """`spool.reject` for a measurement, or None: a failure record the service will not take
    is dropped (it measured nothing), and a measurement the spool cannot hold is logged (the
    caller says so)."""
    if not entry.measured:
        spool.remove(entry)
        return None
    try:
        return spool.reject(entry, reason)
    except OSError as e:
        log.error("could not keep the rejected result of %s in %s: %s", entry.label, spool.rejected_dir, e)
        return None


def _fail_refused(client: Client, entry: SpoolEntry, message: str) -> str:
    """End the lease of a trial whose result the service refused (422: malformed, or another
    config than the leased one) with a failure record, which always passes: otherwise the trial
    stays leased to this worker, the next lease hands it back, and the same probe runs again
    and again. What became of the trial, in words (for the rejected file and the console)."""
    try:
        client.complete(entry.trial_id, entry.worker_id, {"failure": {"kind": "error", "message": message[:1900]}},
                        retry_for_s=COMPLETE_REFUSED_RETRY_S, **_token(entry))
    except ClientError as e:
        log.warning("could not fail %s after its result was refused: %s", entry.label, e)
        return (f"the trial could not be failed either ({e}): it stays leased until the service's lease grace "
                "ends, then its reaper fails it as lost and re-runs it while the study's max_retries allow")
    return "the trial was completed as failed (kind error, naming the refusal): the service does not re-run it"


def _token(entry: SpoolEntry) -> dict[str, Any]:
    """The lease token to send with `entry`'s complete, as keyword arguments (none: nothing sent)."""
    return {"lease_token": entry.lease_token} if entry.lease_token else {}


def another_lease(entry: SpoolEntry, api: str, detail: str) -> str:
    """Why `entry` stays kept when the service at `api` holds its trial id under another lease."""
    return (f"it belongs to {entry.home}; the service at {api} holds trial id {entry.trial_id} under another lease "
            f"(its words: {detail}). Not delivered there, so that it cannot land in another trial. Delivered when "
            "the service on the trial's database answers")


def deliver(spool: Spool, client: Client, entry: SpoolEntry, retry_for_s: float | None,
            interruptible: bool | None = None) -> Delivery:
    """Complete `entry`'s trial with its result, as the worker that measured it; remove the file
    once the service has the result, move it to rejected/ when the service will never take it,
    keep it otherwise (see the module docstring). Never raises for a reply of the service.
    Whether the service is the entry's is the caller's check (`misplaced`)."""
    kept = entry.path
    try:
        info = client.complete(entry.trial_id, entry.worker_id, entry.result, retry_for_s=retry_for_s,
                               interruptible=interruptible, **_token(entry))
    except ServiceUnavailable as e:
        return Delivery("unreachable", str(e), path=kept)
    except Unauthorized as e:
        return Delivery("kept", unauthorized_hint(client.base_url, f"HTTP {e.status_code}: {e.message}"), path=kept,
                        unauthorized=True)
    except Conflict as e:
        if ANOTHER_LEASE in e.message:  # the service checks the token first: it was never this lease's trial
            return Delivery("kept", another_lease(entry, client.base_url, e.message), path=kept)
        already = _ALREADY.search(e.message)
        who = already.group("who") if already else None
        if already and (who is None or who[1:-1] == entry.worker_id):
            spool.settle(entry)
            spool.remove(entry)
            return Delivery("already", f"the service has its result already ({e.message})")
        if "not leased by this service" in e.message:
            return Delivery("kept", f"the service at {client.base_url} does not know trial {entry.trial_id} "
                                    f"({e.message}): was it started on another database (e.g. without --db)? "
                                    "The result is delivered once the service on the trial's database answers",
                            path=kept)
        spool.settle(entry)
        return Delivery("rejected", f"{e.message} (the service's words: the trial is not this worker's any more, "
                                    "and this measurement is not in its study)",
                        path=_reject(spool, entry, f"HTTP 409: {e.message}"))
    except NotFound as e:
        return Delivery("kept", f"the service at {client.base_url} does not know trial {entry.trial_id} "
                                f"({e.message}): was it started on another database (e.g. without --db)?", path=kept)
    except Invalid as e:
        fate = _fail_refused(client, entry, f"the service refused the probe's result: {e.message}")
        spool.settle(entry)
        path = _reject(spool, entry, f"HTTP 422: {e.message}; {fate}")
        return Delivery("rejected", f"the service refused the result: {e.message}; {fate}", path=path)
    except ApiError as e:
        return Delivery("kept", f"the service answered {e}", path=kept)
    except ValueError as e:  # the wire model refused the result before it was sent
        fate = _fail_refused(client, entry, f"the probe's result is not one the protocol accepts: {e}")
        spool.settle(entry)
        path = _reject(spool, entry, f"invalid result: {e}; {fate}")
        return Delivery("rejected", f"the result is not one the protocol accepts: {e}; {fate}", path=path)
    spool.settle(entry)  # first: a worker that finds the file gone finds the note
    spool.remove(entry)
    return Delivery("delivered", f"→ {info.state}", info=info)


def belongs_to(entry: SpoolEntry, api: str, service_id: str | None) -> bool:
    """Whether `entry` is a result for the service at `api` that shows `service_id`: an entry of
    that service id (whatever the URL it was leased at: the id names the database), or, where
    either id is unknown (an older worker's entry, an older service), one leased at that URL."""
    if entry.service_id is None or service_id is None:
        return entry.api == api.rstrip("/")
    return entry.service_id == service_id


def deliver_entries(spool: Spool, client: Client, entries: list[SpoolEntry], service_id: str | None,
                    retry_for_s: float | None,
                    interruptible: bool | None = True) -> Iterator[tuple[SpoolEntry, Delivery]]:
    """Offer `entries` to the service at `client`, which shows `service_id` now, in turn: each
    held for its delivery (`Spool.claim`: one another deliverer holds is skipped), checked
    (`misplaced`; each study's trials read once) and delivered (`deliver`); yields what became
    of each. The caller stops when no other delivery would fare better (an unreachable service,
    a refused token). The worker's delivery round and ``autotune spool deliver``."""
    listings: dict[str, Listing] = {}  # the studies' trials, read once
    for entry in entries:
        with spool.claim(entry) as mine:
            if not mine:
                continue  # another worker on this spool is delivering it (or has)
            outcome = misplaced(client, entry, service_id, retry_for_s, listings, interruptible=interruptible) or \
                deliver(spool, client, entry, retry_for_s, interruptible=interruptible)
        yield entry, outcome


def spool_command(root: Path, verb: str = "list") -> str:
    """The command line that runs ``autotune spool VERB`` on the spool at `root` (--spool-dir
    only where it is not the default one)."""
    try:
        default = Path(root).resolve() == default_spool_dir().resolve()
    except OSError:
        default = False
    return f"autotune spool {verb}" + ("" if default else f" --spool-dir {shlex.quote(str(root))}")


def services_named(entries: list[SpoolEntry], most: int = 3) -> str:
    """The services `entries` belong to, in words: 'service ID at URL' (the URL alone for an
    entry without an id), the first `most` of them, then how many more."""
    names = list(dict.fromkeys(f"service {e.service_id} at {e.api}" if e.service_id else e.api for e in entries))
    more = f", and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more
