"""The command line (`autotune ...`, autotune/cli/main.py), the one-shot demo and `autotune
tune`, the report and the terminal tables. It reaches the service through one seam,
`autotune.cli.main.service()`, and starts embedded services as subprocesses."""
