"""Keep a command's stdout for its result: `stdout_to_stderr` sends everything else to stderr.

`autotune probe` runs the user's workload in-process: its model may print a parameter count,
its dataset may print in DataLoader worker processes (which inherit file descriptor 1), C
code may write to fd 1. None of it may reach stdout, where the result goes (``--json``: one
JSON object). The worker's probe child does the same for its whole life
(`autotune.engine.probe_child.claim_stdout`).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any


def _flush_c_stdio() -> None:
    """fflush(NULL): C's buffered stdout (printf in an extension) goes out to the fd it was written for."""
    with suppress(OSError, AttributeError, TypeError):  # no C library to load (not POSIX)
        ctypes.CDLL(None).fflush(None)


def _flush(*streams: Any) -> None:
    for stream in {id(s): s for s in streams if s is not None}.values():
        with suppress(OSError, ValueError):  # closed, or a broken pipe
            stream.flush()


def divert_stdout() -> int | None:
    """Point standard output at standard error, for this process and those it starts: flush
    Python's and C's buffers, point fd 1 at fd 2 and `sys.stdout` at `sys.stderr`. Returns a
    private duplicate of the old fd 1 (the caller's to write to or restore), or None when fd 1
    or fd 2 is not open (then only `sys.stdout` is redirected)."""
    _flush(sys.stdout, sys.__stdout__, sys.stderr)
    _flush_c_stdio()
    saved_fd: int | None = None
    try:
        saved_fd = os.dup(1)
        os.dup2(2, 1)
    except OSError:
        if saved_fd is not None:
            os.close(saved_fd)
            saved_fd = None
    sys.stdout = sys.stderr
    return saved_fd


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While the block runs, everything written to standard output goes to standard error.

    On entry, Python's and C's buffered output is flushed, file descriptor 1 is pointed at
    fd 2 (its own target kept in a private duplicate) and `sys.stdout` is set to
    `sys.stderr`. So `print`, writes to `sys.__stdout__`, C-level writes to fd 1 and every
    process started in the block (DataLoader workers, compile workers, subprocesses: they
    inherit fd 1) write to stderr. On exit, normal or by an exception, everything written
    in the block is flushed (to stderr), then fd 1 and `sys.stdout` are restored: what the
    caller writes afterwards reaches the real stdout, and nothing of the block follows it
    there. Processes still running after the block keep writing to stderr.

    When fd 1 or fd 2 is not open (a process started with it closed), only `sys.stdout` is
    redirected. The redirect is process-wide (file descriptors and `sys.stdout` are global):
    other threads' output goes to stderr as well while the block runs.
    """
    saved_stdout = sys.stdout
    saved_fd = divert_stdout()
    try:
        yield
    finally:
        _flush(sys.stdout, saved_stdout, sys.__stdout__, sys.stderr)
        _flush_c_stdio()
        if saved_fd is not None:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
        sys.stdout = saved_stdout
