"""Stop strings: cut the generated text where the first of them begins.

Text is streamed in deltas, and a stop string may span several of them, so the last
``len(longest stop) - 1`` characters are held back until the next delta shows whether they
begin a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Filters one request's text deltas through its stop strings."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, delta: str, armed: bool = True) -> tuple[str, bool]:
        """The text that can be sent now, and whether a stop string ended the text (the stop
        string itself is not sent). Not ``armed`` (the request's first ``min_tokens`` tokens),
        the text is sent as it is and never searched."""
        if not armed:
            out, self.pending = self.pending + delta, ""
            return out, False
        self.pending += delta
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """What is held back, once the text has ended without a stop string."""
        out, self.pending = self.pending, ""
        return out
