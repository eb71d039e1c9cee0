"""Error and warning checks that pin what a message names, not how it is worded.

``raises_naming(ConfigError, "max_seq_len", "100")`` expects a ``ConfigError`` whose message
names every fragment: the field or argument, the offending value, the limit. A fragment is a
plain string compared with ``in``; where it starts or ends with a letter, digit or underscore,
that end must not run on into one more (so ``"10"`` is not found in ``"100"`` and
``"num_layers"`` is not found in ``"num_layers_total"``). The connecting prose of the message is
free to change.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def _pattern(fragment: str) -> re.Pattern[str]:
    head = r"(?<!\w)" if re.match(r"\w", fragment) else ""
    tail = r"(?!\w)" if re.search(r"\w$", fragment) else ""
    return re.compile(head + re.escape(fragment) + tail)


def missing_fragments(message: str, fragments: tuple[str, ...]) -> list[str]:
    """The fragments that ``message`` does not name."""
    return [f for f in fragments if not _pattern(f).search(message)]


def assert_names(message: str, *fragments: str) -> None:
    """Assert that ``message`` names every fragment, reporting the ones it lacks."""
    if not fragments:
        raise ValueError("assert_names needs at least one fragment")
    missing = missing_fragments(message, fragments)
    assert not missing, f"message {message!r} does not name {missing!r}"


@contextmanager
def raises_naming(
    exc_type: type[BaseException] | tuple[type[BaseException], ...], *fragments: str
) -> Iterator[pytest.ExceptionInfo]:
    """``pytest.raises(exc_type)`` whose message must name every fragment."""
    with pytest.raises(exc_type) as info:
        yield info
    assert_names(str(info.value), *fragments)


@contextmanager
def warns_naming(category: type[Warning], *fragments: str) -> Iterator[list]:
    """``pytest.warns(category)`` where one such warning's message names every fragment."""
    with pytest.warns(category) as record:
        yield record
    messages = [str(w.message) for w in record if issubclass(w.category, category)]
    if not any(not missing_fragments(m, fragments) for m in messages):
        pytest.fail(f"no {category.__name__} names all of {list(fragments)!r}: {messages!r}")
