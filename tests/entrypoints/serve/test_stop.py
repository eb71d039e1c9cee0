"""Stop strings over streamed text: the text ends where the first stop string begins, whichever
deltas it is split across, and nothing is held back at the end."""

import pytest

from kvgraph.entrypoints.serve.stop import StopStrings


def _run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    s = StopStrings(stops)
    out = []
    for delta in deltas:
        text, stopped = s.feed(delta)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + s.flush(), False


@pytest.mark.parametrize(
    "deltas",
    [["hello END world"], ["hel", "lo E", "N", "D wor", "ld"], list("hello END world")],
    ids=["one delta", "split", "char by char"],
)
def test_text_ends_before_the_stop_string(deltas):
    assert _run(["END"], deltas) == ("hello ", True)


def test_the_earliest_of_several_stop_strings_wins():
    assert _run(["world", "lo"], ["hello ", "world"]) == ("hel", True)


def test_without_a_match_all_text_comes_out():
    assert _run(["STOP"], ["a S", "TO", "p"]) == ("a STOp", False)
    assert _run([], ["x", "y"]) == ("xy", False)


def test_text_that_may_begin_a_stop_string_is_held_back():
    s = StopStrings(["abc"])
    assert s.feed("xxab") == ("xx", False)
    assert s.feed("d") == ("a", False)  # the last two characters could still begin "abc"
    assert s.flush() == "bd"


def test_text_fed_unarmed_is_sent_whole_and_never_searched():
    s = StopStrings(["END"])
    assert s.feed("xEN", armed=False) == ("xEN", False)
    assert s.feed("D y END", armed=True) == ("D y ", True)  # only what came armed is searched
