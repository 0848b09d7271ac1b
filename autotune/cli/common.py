"""What every command of the command line shares: the error console and usage errors (exit
status 2), the --api/--token/--token-file options, the token's resolution, and a service
client whose errors become a message and an exit status."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape as rich_escape

from autotune.worker.client import ApiError, Client, Invalid, ServiceUnavailable


def make_console(*, stderr: bool = False, **options: Any) -> Console:
    """A console for the command line's output: emoji codes off (":x:" in a message, a device
    such as cuda:x:, is text), the rest of rich's `options` as given. Every CLI console is made here."""
    return Console(stderr=stderr, emoji=False, **options)


err = make_console(stderr=True)


class FolderError(ValueError):
    """A folder option (--workdir, --out) cannot be made a directory: bad input, said before anything starts."""


def make_folder(path: Path, option: str) -> Path:
    """`path`, absolute and made with its parents; FolderError naming `option` when it cannot be."""
    path = path.resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file of that name is in the way" if path.exists() else e.strerror or str(e)
        raise FolderError(f"{option} {path}: cannot make it a directory ({why}); give a directory this user "
                          "can write") from None
    return path


class SpecFileError(ValueError):
    """A study spec file that cannot be read as one: the message names the file and what is wrong."""


def read_spec_file(path: Path) -> dict[str, Any]:
    """The mapping of study fields in the YAML or JSON file `path`; SpecFileError naming the file
    when it is missing, not YAML/JSON, or not a mapping."""
    import yaml

    if not path.is_file():
        raise SpecFileError(f"{path}: no such file; give a YAML or JSON study spec")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SpecFileError(f"{path}: not valid YAML/JSON ({e})") from None
    if not isinstance(data, dict):
        raise SpecFileError(f"{path}: expected a mapping of study fields (name, space, n_trials, ...)")
    return data


def spec_errors(exc: Any) -> str:
    """A pydantic ValidationError of a StudySpec as 'field: message' lines."""
    lines = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error.get("loc", ()))
        msg = str(error.get("msg", "")).removeprefix("Value error, ")
        lines.append(msg if not field or msg.startswith(field) else f"{field}: {msg}")
    return "; ".join(lines)


def say_error(message: str, console: Console = err) -> None:
    """Print "error: MESSAGE" on `console` (stderr by default), the message as written: brackets
    are not markup, and the console has no emoji codes."""
    console.print(f"[bold red]error:[/] {rich_escape(message)}", highlight=False, soft_wrap=True)


def usage_error(message: str) -> typer.Exit:
    """Print a usage error (naming the bad input and the fix) and return exit code 2."""
    say_error(message)
    return typer.Exit(code=2)


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
        say_error(f"cannot reach the autotune service at {client.base_url}: start it with `autotune serve` (or pass "
                  f"--api URL / set AUTOTUNE_API)\n  ({e.cause})")
        raise typer.Exit(code=1) from None
    except Invalid as e:
        raise usage_error(e.message) from None
    except ApiError as e:
        say_error(e.message)
        raise typer.Exit(code=1) from None
    finally:
        client.close()
