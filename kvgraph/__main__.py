"""``python -m kvgraph ...`` (and ``torchrun ... -m kvgraph ...``): the ``kvgraph`` command line."""

import sys

from kvgraph.entrypoints.cli import main

sys.exit(main())
