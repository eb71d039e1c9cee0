"""Whether Linux would back a memory address with transparent huge pages (its VMA's
``THPeligible`` in ``/proc/self/smaps``), and how much of its mapping is resident, for the tests of
memory advised ``MADV_HUGEPAGE`` and populated up front."""

import sys
from pathlib import Path

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages (``always``, ``madvise``, ``never``), or None."""
    if not sys.platform.startswith("linux") or not THP_MODE.exists():
        return None
    text = THP_MODE.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _field(address: int, name: str) -> str | None:
    """The first value of ``name:`` in the smaps entry of the mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith(name + ":"):
            return line.split()[1]
    return None


def thp_eligible(address: int) -> bool | None:
    """The ``THPeligible`` flag of the mapping that holds ``address``; None if smaps lacks it."""
    value = _field(address, "THPeligible")
    return None if value is None else value == "1"


def resident_bytes(address: int) -> int | None:
    """Bytes of the mapping that holds ``address`` in memory now (its ``Rss``); None if unmapped."""
    value = _field(address, "Rss")
    return None if value is None else int(value) * 1024
