"""``python -m kvgraph ...`` (and ``torchrun ... -m kvgraph ...``): the ``kvgraph`` command line."""

from kvgraph.entrypoints.cli import run

run()
