"""The ``kvgraph`` command line: ``generate``, ``bench``, ``dump`` and ``serve`` subcommands.

Every caller mistake (unknown preset, missing checkpoint, bad sizes, a prompt that
cannot fit) ends as one ``kvgraph <command>: error: ...`` line on stderr and a
non-zero exit status, never a traceback.

The subcommands (and with them torch) are imported only once the command line is read, so that
``kvgraph serve`` can set OpenMP's environment before libgomp loads (``openmp_env``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from kvgraph import __version__
from kvgraph.entrypoints.cli.heap import freeze_startup_survivors
from kvgraph.entrypoints.cli.openmp_env import apply_serve_default
from kvgraph.entrypoints.cli.process_exit import run_and_exit
from kvgraph.errors import KVGraphError


def build_parser():
    """The ``kvgraph`` parser with every subcommand (this imports them, and torch)."""
    from kvgraph.entrypoints.cli import bench, dump, generate, serve
    from kvgraph.entrypoints.cli.common import ArgumentParser

    parser = ArgumentParser(
        prog="kvgraph",
        description="Compile an unmodified decoder onto a paged KV cache and serve it with continuous batching.",
    )
    parser.add_argument("--version", action="version", version=f"kvgraph {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=ArgumentParser)
    for module in (generate, bench, dump, serve):
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return the exit status."""
    apply_serve_default(sys.argv[1:] if argv is None else argv, os.environ)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KVGraphError as e:
        sys.stderr.write(f"kvgraph {args.command}: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(f"kvgraph {args.command}: interrupted\n")
        return 130


def run() -> None:
    """The ``kvgraph`` console script (and ``python -m kvgraph``): :func:`main` on ``sys.argv``, then
    the process ends without its module teardown (``process_exit``). Its start-up's full garbage
    collections walk only what came after the previous one (``heap``)."""
    freeze_startup_survivors()
    run_and_exit(main)
