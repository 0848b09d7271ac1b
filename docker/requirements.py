"""Print the project's runtime requirements from pyproject.toml, one per line, for `pip install -r`.

    python docker/requirements.py --extra dashboard --exclude torch > requirements.txt

The service image installs these and then the project itself with ``--no-deps``: the
service never imports torch (tests/deploy/test_docker.py checks that), so its image leaves out the
largest dependency. ``--exclude NAME`` drops a requirement by its distribution name;
``--extra NAME`` adds an optional-dependency group. Unknown extras or excluded names that are
not requirements are errors, so a rename in pyproject.toml breaks the image build loudly.
Standard library only (it runs before anything is installed).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirement_name(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement ("psycopg[binary]>=3" -> "psycopg")."""
    match = _NAME.match(requirement)
    if not match:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path, extras: list[str], exclude: list[str]) -> list[str]:
    """[project.dependencies] plus the named extras, minus the excluded names, in file order."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise ValueError(f"unknown extra(s) {unknown}; pyproject.toml defines {sorted(optional)}")
    wanted = list(project["dependencies"]) + [r for e in extras for r in optional[e]]
    dropped = {requirement_name(n) for n in exclude}
    missing = dropped - {requirement_name(r) for r in wanted}
    if missing:
        raise ValueError(f"--exclude {sorted(missing)}: not a requirement in pyproject.toml")
    return [r for r in wanted if requirement_name(r) not in dropped]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--extra", action="append", default=[], help="an optional-dependency group to add")
    parser.add_argument("--exclude", action="append", default=[], help="a distribution name to leave out")
    args = parser.parse_args(argv)
    try:
        lines = requirements(args.pyproject, args.extra, args.exclude)
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
