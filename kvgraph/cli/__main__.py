"""``python -m kvgraph.cli``: the same as the ``kvgraph`` console script."""

import sys

from kvgraph.cli import main

sys.exit(main())
