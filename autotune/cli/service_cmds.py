"""`autotune serve`, `autotune db ...` and `autotune token ...`: run the service, and work on
its database and tokens directly (no running service needed), all through the seam
(`autotune.cli.seam.service`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from autotune.cli.common import err, make_console, say_error, usage_error
from autotune.cli.seam import service


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


DbOption = Annotated[str | None, typer.Option("--db", help="SQLAlchemy database URL (default: AUTOTUNE_DB_URL, "
                                                           "else sqlite:///./autotune.db).")]


def _database_url(db: str | None) -> str:
    """--db, else the service's own default (AUTOTUNE_DB_URL, else sqlite:///./autotune.db)."""
    if db is not None:
        return db
    url: str = service().settings.from_environment().db_url
    return url


@contextmanager
def database_command() -> Iterator[None]:
    """Errors of a command that works on the database as a message and an exit status
    (2: bad input; 1: anything else: unreachable database, failed migration, unknown token)."""
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    errors = service().errors
    migration_error = service().db.MigrationError
    try:
        yield
    except service().settings.SettingsError as e:  # an AUTOTUNE_* variable the service cannot read
        raise usage_error(str(e)) from None
    except errors.Invalid as e:
        raise usage_error(e.detail) from None
    except errors.ServiceError as e:
        say_error(str(e.detail))
        raise typer.Exit(code=1) from None
    except migration_error as e:
        say_error(str(e))
        raise typer.Exit(code=1) from None
    except ArgumentError as e:  # the URL itself does not parse: bad input
        raise usage_error(f"--db / AUTOTUNE_DB_URL: {str(e).splitlines()[0]}; write a SQLAlchemy URL, e.g. "
                          "sqlite:///./autotune.db or postgresql+psycopg://user@host:5432/db") from None
    except SQLAlchemyError as e:
        say_error(f"the database failed ({type(e).__name__}: {str(e).splitlines()[0]}); check --db / AUTOTUNE_DB_URL")
        raise typer.Exit(code=1) from None


def _revision(revision: str | None) -> str:
    return revision or "none (no autotune tables yet)"


def db_upgrade(
    db: DbOption = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Create or migrate the autotune tables to the newest revision (Optuna's tables are left alone)."""
    db_module = service().db
    with database_command():
        before, after = db_module.upgrade_schema(_database_url(db), revision)
    change = f"already at {after}" if before == after else f"{_revision(before)} → {after}"
    make_console().print(f"autotune tables: {change}", highlight=False)


def db_downgrade(
    revision: Annotated[str, typer.Argument(metavar="REV", help="Target revision, e.g. 0001, or base (drops every "
                                                                "autotune table and its data).")],
    db: DbOption = None,
) -> None:
    """Migrate the autotune tables down to REV (Optuna's tables are left alone)."""
    db_module = service().db
    with database_command():
        before, after = db_module.downgrade_schema(_database_url(db), revision)
    make_console().print(f"autotune tables: {_revision(before)} → {_revision(after)}", highlight=False)


def db_current(db: DbOption = None) -> None:
    """Print the revision of the autotune tables (and whether it is the newest)."""
    db_module = service().db
    with database_command():
        current = db_module.current_schema_revision(_database_url(db))
        head = db_module.head_revision()
    note = " (head)" if current == head else f" (newest: {head}; run `autotune db upgrade`)"
    make_console().print(_revision(current) + note, highlight=False)


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
        raise usage_error(str(e)) from None
    except backup.BackupFailed as e:
        say_error(str(e))
        raise typer.Exit(code=1) from None
    make_console().print(result.describe(), markup=False, highlight=False, soft_wrap=True)


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


def token_list(db: DbOption = None) -> None:
    """List the tokens (never their secrets): id, name, role, created, last used, revoked."""
    with token_store(db) as store:
        tokens = store.tokens()
    if not tokens:
        make_console().print("no tokens yet: create one with `autotune token create --role admin`")
        return
    table = Table("id", "name", "role", "created (UTC)", "last used (UTC)", "revoked (UTC)", title="tokens")

    def when(moment: Any) -> str:
        return "-" if moment is None else f"{moment:%Y-%m-%d %H:%M:%S}"

    for t in tokens:
        table.add_row(str(t.id), t.name, t.role, when(t.created_at), when(t.last_used_at), when(t.revoked_at))
    make_console().print(table)


def token_revoke(
    name_or_id: Annotated[str, typer.Argument(metavar="NAME_OR_ID", help="The token's name or id "
                                                                         "(`autotune token list`).")],
    db: DbOption = None,
) -> None:
    """Revoke a token: the service refuses it within seconds (its row is kept). Exit status 1 if there is none."""
    with token_store(db) as store:
        info = store.revoke(name_or_id)
    make_console().print(f"revoked {info.role} token {info.name!r} (id {info.id})", highlight=False)
