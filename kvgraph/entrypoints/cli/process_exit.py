"""The ``kvgraph`` process's exit: every exit handler runs, the interpreter's module teardown does not.

A command that ran a model has imported torch, Dynamo, Inductor and transformers: millions of
Python objects. A normal exit then tears every module down, and the interpreter runs full garbage
collections over all of them as it goes (``gc_collect_main`` under ``perf``): 1.5-1.8 s at the end
of ``kvgraph generate --model llama-56m`` on a 2-core host, about a fifth of its 8.5-9 s second
start. Nothing a user can see happens in that teardown.

:func:`run_and_exit` registers its ender before the command imports anything that registers exit
handlers of its own, so the ender runs last: after non-daemon threads are joined and after every
other ``atexit`` handler (multiprocessing's children, temporary directories, torch's and a tensor
parallel group's cleanups). The one handler registered earlier, ``logging.shutdown`` (the package
imports ``logging``), it calls itself. It then flushes the standard streams and ends the process
with ``os._exit`` and the command's status: 0, the status the command returned or passed to
``sys.exit``, 130 on an interrupt, 1 after an uncaught exception (whose traceback Python has
already printed).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn


def exit_status(code: object) -> int:
    """The process status of ``sys.exit(code)``: 0 for ``None``, the int itself, 1 for anything else
    (Python prints a non-int code to stderr and exits with 1)."""
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code & 0xFF
    return 1


def run_and_exit(main: Callable[[], int | None]) -> NoReturn:
    """Run ``main`` and end the process with its status once every exit handler has run (see the
    module's docstring): the ``kvgraph`` console script and ``python -m kvgraph``."""
    status = 1  # what an uncaught exception leaves

    def end() -> None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can be written to it
                continue
        os._exit(status)

    atexit.register(end)
    try:
        code = main()
    except SystemExit as e:
        status = exit_status(e.code)
        raise
    except KeyboardInterrupt:
        status = 130
        raise
    status = exit_status(code)
    sys.exit(code)
