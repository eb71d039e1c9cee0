"""How long OpenMP's idle threads spin before they sleep, for ``kvgraph serve``: set before torch loads.

PyTorch's CPU build runs its kernels on GNU OpenMP. After each parallel region libgomp's worker
threads spin for ``GOMP_SPINCOUNT`` iterations (300 000 by default, several hundred microseconds)
waiting for the next one, on a core that the server's HTTP front end and its clients also need. The
front end then runs in the time slices the spinning leaves, and each region of the next step waits
for whichever thread was descheduled. A thread that sleeps too soon has to be woken for the next
region instead, which a step of a few hundred regions pays each time. ``kvgraph serve`` spins
30 000 times, between the counts measured best on two hosts, at 32 streams of ``llama-56m``
(``benchmarks/RESULTS.md``, "OpenMP's spin on a shared CPU" and its 2026-11-29 sequel):
- on a 2-core Zen 4, 1 000 spins served 6 % faster than 300 000 at the median of five alternating runs;
- on a 2-core Zen 3, 30 000 served faster than 1 000 in 13 of 16 alternating rounds (medians 0.914
  against 0.852 of the in-process engine in the last run), and 300 000 faster than 1 000 in 14 of 18.
The in-process engine, which shares its cores with nobody, is not affected.

libgomp reads the variable once, when torch loads it, so the default has to be in the environment
before ``import torch``: the command line applies it before it imports its subcommands (the
engine process is forked from the front end, or spawned with its environment, and inherits it). A
user's own ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is kept as it is.
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping, Sequence

SERVE_SPIN_COUNT = "30000"
"""``GOMP_SPINCOUNT`` of ``kvgraph serve`` unless the user set it or ``OMP_WAIT_POLICY``."""

USER_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def apply_serve_default(argv: Sequence[str], environ: MutableMapping[str, str]) -> str | None:
    """Set ``GOMP_SPINCOUNT`` in ``environ`` for a ``serve`` command line ``argv`` (without the
    program name) when the user set neither variable and torch is not loaded yet (afterwards libgomp
    would not read it, and a value that does nothing would mislead). Returns the value set, or
    ``None`` where nothing was set."""
    if not argv or argv[0] != "serve" or "torch" in sys.modules:
        return None
    if any(name in environ for name in USER_VARIABLES):
        return None
    environ["GOMP_SPINCOUNT"] = SERVE_SPIN_COUNT
    return SERVE_SPIN_COUNT
