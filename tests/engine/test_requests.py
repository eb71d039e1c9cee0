"""Completion's repr: one line, ids and text shortened, no timings."""

from kvgraph.engine.requests import Completion


def test_completion_repr_is_one_short_line():
    c = Completion(list(range(32)), "x" * 100, "length", 18, 4, 0.0, [0.1] * 32)
    text = repr(c)
    assert text == (
        "Completion(finish_reason='length', 32 tokens [0, 1, 2, 3, 4, 5, 6, 7, ...], "
        f"text='{'x' * 40}...', prompt_tokens=18, cached_tokens=4)"
    )
    failed = Completion([1], None, "error", 3, 0, error="RuntimeError: boom")
    assert repr(failed).endswith("text=None, prompt_tokens=3, cached_tokens=0, error='RuntimeError: boom')")
