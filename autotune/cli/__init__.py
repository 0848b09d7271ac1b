"""The command line (`autotune ...`: the app in autotune/cli/main.py, the commands in its
*_cmd(s).py modules), the one-shot demo and `autotune tune`, the report and the terminal
tables. It reaches the service through one seam, `autotune.cli.seam.service()`, and starts
embedded services as subprocesses."""
