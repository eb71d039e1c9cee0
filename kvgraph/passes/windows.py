"""What is known of a model's sliding windows before one of its graphs is lowered, and from where."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvgraph.errors import ConfigError


class WindowOrigin(enum.Enum):
    """Where a model's sliding windows were learnt (the value names it in messages)."""

    CONFIG = "the model's config"
    OPTIONS = "the backend's windows option"
    SEVERAL_TOKENS = "the model's graph of several tokens"


@dataclass(frozen=True, kw_only=True)
class KnownWindows:
    """Each attention site's sliding window, in graph order (``None``: plain causal), known before
    a graph is lowered, and where from."""

    sizes: tuple[int | None, ...]
    origin: WindowOrigin

    def __post_init__(self) -> None:
        bad = [w for w in self.sizes if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1)]
        if bad:
            raise ConfigError(f"sliding windows must be positive ints or None, got {bad[0]!r} in {self.sizes}")
