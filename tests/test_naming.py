"""The message checks of tests/naming.py fail on a missing or run-on fragment."""

import warnings

import pytest

from tests.naming import assert_names, raises_naming, warns_naming


def test_every_fragment_must_be_named():
    assert_names("sequence 0 reaches 11 tokens, past max_seq_len 10", "sequence 0", "11", "max_seq_len 10")
    with pytest.raises(AssertionError, match=r"\['12'\]"):
        assert_names("sequence 0 reaches 11 tokens", "sequence 0", "12")


def test_a_fragment_does_not_match_inside_a_longer_word_or_number():
    with pytest.raises(AssertionError):
        assert_names("max_seq_len=100", "max_seq_len=10")
    with pytest.raises(AssertionError):
        assert_names("num_layers_total=2", "num_layers")
    assert_names("got 'fast' (KVGRAPH_CPU_ATTENTION)", "'fast'", "KVGRAPH_CPU_ATTENTION")


def test_raises_naming_checks_type_and_fragments():
    with raises_naming(ValueError, "n", "3") as info:
        raise ValueError("n=3")
    assert isinstance(info.value, ValueError)
    with pytest.raises(AssertionError, match="does not name"), raises_naming(ValueError, "n", "4"):
        raise ValueError("n=3")
    with pytest.raises(KeyError), raises_naming(ValueError, "n"):
        raise KeyError("n")


def test_warns_naming_needs_one_warning_naming_all():
    with warns_naming(RuntimeWarning, "cpp", "SDPA"):
        warnings.warn("cpp failed; falls back to SDPA", RuntimeWarning, stacklevel=1)
    with pytest.raises(pytest.fail.Exception, match="names all of"), warns_naming(RuntimeWarning, "cpp", "SDPA"):
        warnings.warn("cpp failed", RuntimeWarning, stacklevel=1)
