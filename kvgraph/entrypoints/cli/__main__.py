"""``python -m kvgraph.entrypoints.cli``: the same as the ``kvgraph`` console script."""

import sys

from kvgraph.entrypoints.cli import main

sys.exit(main())
