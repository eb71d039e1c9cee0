"""The passes' logger: every pass logs what it matched and how long it took."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("kvgraph.passes")


def log_pass(name: str, start: float, summary: str) -> float:
    """Log ``name: summary (ms)`` for a pass that began at ``time.perf_counter() == start``; return seconds."""
    seconds = time.perf_counter() - start
    logger.info("%s: %s (%.1f ms)", name, summary, seconds * 1e3)
    return seconds
