"""The ``autopar`` console command's entry point: Ctrl-C at any moment exits 130, one line.

Two things stand in the way of catching ``KeyboardInterrupt`` in ``autopar.cli.main``
alone. The command spends its first seconds importing ``autopar``, whose ``__init__``
imports torch, before ``main`` is entered: an interrupt there is a long traceback. And an
interrupt raised inside torch's own machinery is not always an exception that reaches
``main``: raised in a Python callback that C++ calls, it aborts the process
(``terminate called after throwing an instance of 'python_error'``); raised inside
``torch.export``, it is caught and reported as an untraceable model.

So this module, outside the ``autopar`` package (importing it imports no torch), sets a
SIGINT handler before anything else is imported: it prints one line and ends the process
at once with 130, wherever the interpreter was. Files are not left half-written by it:
``autopar_plans.writes`` holds SIGINT back while a file is written and renamed. A SIGINT
that was ignored when the command started (``nohup``, a background job) stays ignored.

``python -m autopar`` works as before, with ``autopar.cli.main``'s own handling.

The command also ends without the interpreter's teardown (``end_now``): once it has
returned and every exit handler has run, the process exits with the command's code instead
of freeing, one by one, every object the traces and solves left alive (0.8-1.0 s of the
6 s ``autopar plan llama3-8b --mesh 8x8`` took). A command that raised is reported and
torn down as usual.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run ``autopar.cli.main`` with the interrupt handler installed first."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, exit_interrupted)
    from autopar_passes.collector import collector_paused  # imports no torch

    with collector_paused():  # torch's import makes half a million objects
        from autopar.cli import main as run

    end_now(run(argv))


def end_now(code: int) -> NoReturn:
    """Exit with ``code`` as ``sys.exit`` would, less the interpreter's teardown: every
    exit handler runs (torch's, logging's, multiprocessing's, in Python's order), the
    standard streams are flushed, and the process ends. Where a thread that is not a
    daemon still runs, Python's own exit waits for it."""
    main_thread = threading.main_thread()
    if any(t.is_alive() and not t.daemon and t is not main_thread for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()  # what Python's exit runs before its teardown
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a broken pipe
            stream.flush()
    os._exit(code)


def exit_interrupted(signum: int, frame: FrameType | None) -> None:
    """Say so in one line and end the process now: no unwinding through torch's C++."""
    del signum, frame
    # to the file descriptor, not sys.stderr: the handler may have cut into a write to it;
    # with stderr closed or gone, the exit code still says it
    with contextlib.suppress(OSError):
        os.write(2, b"autopar: interrupted\n")
    os._exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
