"""`python -m autotune.cli ...` is `autotune ...`."""

from autotune.cli.main import app

app()
