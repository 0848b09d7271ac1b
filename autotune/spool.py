"""The worker's spool: probe results the service's database does not hold yet, one JSON file each.

A probe costs minutes of a GPU; its result must not die with a network outage, a service
restarted on another database (401), a 5xx, or the worker itself. So the worker writes each
result here *before* it calls complete (write-ahead: atomically, temp file + fsync + rename)
and removes the file once the service has it. Whatever happens in between, the measurement
is on disk: a worker started on the same spool delivers it when the service answers again
(at its start, and before and after every lease; `Worker.deliver_spool`).

Layout (default `default_spool_dir`; ``autotune worker --spool-dir DIR`` or
$AUTOTUNE_SPOOL_DIR sets another)::

    DIR/trial-<id>-<hash>.json             waiting for the service (hash: service URL + worker id)
    DIR/rejected/trial-<id>-<hash>.json    the service will not take it; kept, with its reason

Each file is a `SpoolEntry`: the service URL, trial id, study, trial number, the worker id
that held the lease (a delivery completes as that worker: the service accepts a result only
from the lease holder, and a restarted worker has a new default id), the result, and when it
was spooled. A worker delivers only the entries of the service it talks to (`--api`): a
spool shared by workers of several services sorts itself out.

Delivery (`deliver`) is idempotent, because the service keeps the first result it is given:

    200                                 delivered: the file is removed
    409 "already completed" (this       the service has it already (an earlier delivery whose
        worker's)                       reply was lost): the file is removed
    409 another worker's / reaped /     the service re-ran the trial, or will: a measurement is
        ended lease; 422                moved to rejected/ with the reason (never deleted); a
                                        failure record (it measured nothing) is dropped; after
                                        a 422 the trial is completed as failed (kind error,
                                        naming the refusal): its lease ends, it is not re-run
    409 "not leased by this service",   the service does not know the trial: most likely one
        404                             started on another database; kept, offered again later
    401/403                             the token is not accepted (a service started on another
                                        database, e.g. without --db, or a revoked token): kept
    unreachable, 5xx                    kept; offered again when the service answers

The lease and the spool: the service's reaper fails a lease whose heartbeats stop for its
grace period (AUTOTUNE_LEASE_GRACE_S, 60 s by default) and re-runs the trial. A restarted
service gives every lease one grace period from its start, and a worker delivers its spool
within seconds of the service answering, so a service outage or restart costs nothing. A
worker cut off from a *running* service for longer than the grace (a network partition; a
worker killed and restarted late) finds its lease reaped: its result goes to rejected/ with
the service's reason, and the re-run's result is the one the study keeps.

Concurrency: workers on one host may share a spool. A delivery holds an exclusive flock on
the entry's file (`Spool.claim`), so two workers do not hand in the same file at once; and
were they to, the service's idempotence makes the second a no-op.
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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from autotune.client import (
    ApiError,
    Client,
    ClientError,
    Conflict,
    Invalid,
    NotFound,
    ServiceUnavailable,
    Unauthorized,
)
from autotune.protocol import TrialInfo

log = logging.getLogger(__name__)

SPOOL_ENV = "AUTOTUNE_SPOOL_DIR"
REJECTED = "rejected"
FORMAT = 1
COMPLETE_REFUSED_RETRY_S = 10.0  # how long the failure record that ends a refused result's lease is retried
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
    spooled_at: str = field(default_factory=utc_now)
    rejected_at: str | None = None
    reason: str | None = None  # rejected: why the service would not take it
    path: Path | None = field(default=None, compare=False)  # where it lies (None: not on disk)

    @property
    def filename(self) -> str:
        digest = hashlib.sha256(f"{self.api}\n{self.worker_id}".encode()).hexdigest()[:12]
        return f"trial-{self.trial_id}-{digest}.json"

    @property
    def label(self) -> str:
        return f"trial {self.number} of {self.study} (id {self.trial_id})"

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


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader (or a crash) sees the old file or the whole new one:
    a temp file in the same directory, fsync, rename, fsync of the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


class Spool:
    """A spool directory (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._unreadable_said: set[Path] = set()

    @property
    def rejected_dir(self) -> Path:
        return self.root / REJECTED

    def put(self, entry: SpoolEntry) -> Path:
        """Write `entry` (replacing an older file of the same trial, service and worker); its path.
        Raises OSError when the directory cannot be written."""
        path = self.root / entry.filename
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
                if path.exists() and path not in self._unreadable_said:  # said once, and left alone
                    self._unreadable_said.add(path)
                    log.warning("%s; left in place", e)
        return sorted(entries, key=lambda e: (e.spooled_at, e.trial_id))

    def pending(self, api: str | None = None) -> list[SpoolEntry]:
        """The entries waiting for delivery, oldest first (only those of service `api` if given)."""
        entries = self._read_all(self.root)
        return entries if api is None else [e for e in entries if e.api == api.rstrip("/")]

    def rejected(self) -> list[SpoolEntry]:
        return self._read_all(self.rejected_dir)

    def find(self, api: str, trial_id: int, worker_id: str) -> SpoolEntry | None:
        """The pending entry of this trial, service and worker, if there is one."""
        probe = SpoolEntry(api=api.rstrip("/"), trial_id=trial_id, worker_id=worker_id, study="", number=0, result={})
        path = self.root / probe.filename
        if not path.exists():
            return None
        try:
            return SpoolEntry.read(path)
        except ValueError:
            return None

    def remove(self, entry: SpoolEntry) -> None:
        """Forget a delivered entry (harmless when another worker removed it first)."""
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)
            _fsync_dir(entry.path.parent)

    def reject(self, entry: SpoolEntry, reason: str) -> Path:
        """Move `entry` to rejected/ with `reason` (written first, then the pending file removed:
        a crash in between leaves it in both places, never in neither); its new path."""
        pending = entry.path
        entry.reason, entry.rejected_at = reason, utc_now()
        target = self.rejected_dir / entry.filename
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


def _reject(spool: Spool, entry: SpoolEntry, reason: str) -> Path | None:
    """`spool.reject` for a measurement, or None: a failure record the service will not take
    is dropped (it measured nothing; the service re-runs or has re-run the trial), and a
    measurement the spool cannot hold is logged (the caller says so)."""
    if not entry.measured:
        spool.remove(entry)
        return None
    try:
        return spool.reject(entry, reason)
    except OSError as e:
        log.error("could not keep the rejected result of %s in %s: %s", entry.label, spool.rejected_dir, e)
        return None


def _fail_refused(client: Client, entry: SpoolEntry, message: str) -> None:
    """End the lease of a trial whose result the service refused (422: malformed, or another
    config than the leased one) with a failure record, which always passes: otherwise the trial
    stays leased to this worker, the next lease hands it back, and the same probe runs again
    and again. The refused measurement itself is in rejected/."""
    try:
        client.complete(entry.trial_id, entry.worker_id, {"failure": {"kind": "error", "message": message[:1900]}},
                        retry_for_s=COMPLETE_REFUSED_RETRY_S)
    except ClientError as e:  # the lease ends with the grace period instead; the service re-runs it
        log.warning("could not fail %s after its result was refused: %s", entry.label, e)


def deliver(spool: Spool, client: Client, entry: SpoolEntry, retry_for_s: float | None,
            interruptible: bool | None = None) -> Delivery:
    """Complete `entry`'s trial with its result, as the worker that measured it; remove the file
    once the service has the result, move it to rejected/ when the service will never take it,
    keep it otherwise (see the module docstring). Never raises for a reply of the service."""
    kept = entry.path
    try:
        info = client.complete(entry.trial_id, entry.worker_id, entry.result, retry_for_s=retry_for_s,
                               interruptible=interruptible)
    except ServiceUnavailable as e:
        return Delivery("unreachable", str(e), path=kept)
    except Unauthorized as e:
        return Delivery("kept", unauthorized_hint(client.base_url, f"HTTP {e.status_code}: {e.message}"), path=kept,
                        unauthorized=True)
    except Conflict as e:
        already = _ALREADY.search(e.message)
        who = already.group("who") if already else None
        if already and (who is None or who[1:-1] == entry.worker_id):
            spool.remove(entry)
            return Delivery("already", f"the service has its result already ({e.message})")
        if "not leased by this service" in e.message:
            return Delivery("kept", f"the service at {client.base_url} does not know trial {entry.trial_id} "
                                    f"({e.message}): was it started on another database (e.g. without --db)? "
                                    "The result is delivered once the service on the trial's database answers",
                            path=kept)
        return Delivery("rejected", e.message, path=_reject(spool, entry, f"HTTP 409: {e.message}"))
    except NotFound as e:
        return Delivery("kept", f"the service at {client.base_url} does not know trial {entry.trial_id} "
                                f"({e.message}): was it started on another database (e.g. without --db)?", path=kept)
    except Invalid as e:
        path = _reject(spool, entry, f"HTTP 422: {e.message}")
        _fail_refused(client, entry, f"the service refused the probe's result: {e.message}")
        return Delivery("rejected", f"the service refused the result: {e.message}", path=path)
    except ApiError as e:
        return Delivery("kept", f"the service answered {e}", path=kept)
    except ValueError as e:  # the wire model refused the result before it was sent
        path = _reject(spool, entry, f"invalid result: {e}")
        _fail_refused(client, entry, f"the probe's result is not one the protocol accepts: {e}")
        return Delivery("rejected", f"the result is not one the protocol accepts: {e}", path=path)
    spool.remove(entry)
    return Delivery("delivered", f"→ {info.state}", info=info)
