"""The `autotune` command line: the Typer app and the registration of every command (their
code lives in the command modules beside this one: probe_cmd, service_cmds, worker_cmd,
spool_cmds, study_cmds)."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from autotune.cli import check_cmd, probe_cmd, service_cmds, spool_cmds, study_cmds, worker_cmd

app = typer.Typer(
    help="autotune: find the fastest PyTorch training configuration that keeps model quality.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="The service's database: Alembic migrations (`autotune serve` upgrades at start) "
                          "and consistent SQLite backups.",
                     no_args_is_help=True)
token_app = typer.Typer(help="Bearer tokens of the service (roles: worker, admin); work on the database directly.",
                        no_args_is_help=True)
spool_app = typer.Typer(help="The worker's spool: results the service has not taken yet, a folder per service "
                             "(`autotune worker --spool-dir`). list and clear work without a service.",
                        no_args_is_help=True)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging on stderr.")] = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# the commands, in the order `autotune --help` lists them (sub-apps after the commands)
app.command("probe")(probe_cmd.probe)
app.command("serve")(service_cmds.serve)
app.command("worker")(worker_cmd.worker)
app.command("tune")(study_cmds.tune)
app.command("submit")(study_cmds.submit)
app.command("status")(study_cmds.status)
app.command("stop")(study_cmds.stop)
app.command("best")(study_cmds.best)
app.command("check")(check_cmd.check)
app.command("report")(study_cmds.report)
app.command("demo")(study_cmds.demo)

app.add_typer(db_app, name="db")
db_app.command("upgrade")(service_cmds.db_upgrade)
db_app.command("downgrade")(service_cmds.db_downgrade)
db_app.command("current")(service_cmds.db_current)
db_app.command("backup")(service_cmds.db_backup)

app.add_typer(token_app, name="token")
token_app.command("create")(service_cmds.token_create)
token_app.command("list")(service_cmds.token_list)
token_app.command("revoke")(service_cmds.token_revoke)

app.add_typer(spool_app, name="spool")
spool_app.command("list")(spool_cmds.spool_list)
spool_app.command("deliver")(spool_cmds.spool_deliver)
spool_app.command("clear")(spool_cmds.spool_clear)


if __name__ == "__main__":
    app()
