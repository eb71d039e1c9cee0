"""``python -m kvgraph.entrypoints.cli``: the same as the ``kvgraph`` console script."""

from kvgraph.entrypoints.cli import run

run()
