"""``python -m kvgraph ...`` (and ``torchrun ... -m kvgraph ...``): the ``kvgraph`` command line."""

import sys

from kvgraph.cli import main

sys.exit(main())
