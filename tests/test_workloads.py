import pytest

from kvgraph.errors import ConfigError
from kvgraph.workloads import FIRST_TOKEN, make_workload, workload_names
from tests.naming import raises_naming


def test_named_workloads_have_their_documented_shapes():
    mixed = make_workload("mixed", num_requests=50, vocab_size=259)
    assert mixed.max_new_tokens == 64
    assert all(16 <= len(p) <= 256 for p in mixed.prompts)
    assert len({len(p) for p in mixed.prompts}) > 10

    heavy = make_workload("decode-heavy", num_requests=5, vocab_size=259)
    assert heavy.max_new_tokens == 256 and {len(p) for p in heavy.prompts} == {32}

    shared = make_workload("shared-prefix", num_requests=6, vocab_size=259)
    system = shared.prompts[0][:512]
    assert all(p[:512] == system and 528 <= len(p) <= 576 for p in shared.prompts)
    assert len({tuple(p[512:]) for p in shared.prompts}) == 6


@pytest.mark.parametrize("name", workload_names())
def test_workloads_are_seeded_and_stay_in_the_vocabulary(name):
    a = make_workload(name, num_requests=4, vocab_size=50, seed=3)
    assert a == make_workload(name, num_requests=4, vocab_size=50, seed=3)
    assert a != make_workload(name, num_requests=4, vocab_size=50, seed=4)
    assert all(FIRST_TOKEN <= t < 50 for p in a.prompts for t in p)
    assert len(a.prompts) == 4


def test_max_new_tokens_override_and_bad_input():
    assert make_workload("mixed", num_requests=2, vocab_size=259, max_new_tokens=5).max_new_tokens == 5
    with raises_naming(ConfigError, "workload", "'chat'", ", ".join(workload_names())):

        make_workload("chat", num_requests=2, vocab_size=259)
    with pytest.raises(ConfigError, match=r"num_requests.*>= 1.*\b0\b"):
        make_workload("mixed", num_requests=0, vocab_size=259)
