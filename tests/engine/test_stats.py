"""EngineStats: rates over the steps that compiled nothing; KV figures in the cache's own unit."""

import pytest

from kvgraph.engine.stats import EngineStats, kv_usage_text


def test_a_step_that_compiled_counts_its_tokens_but_not_in_the_rates():
    stats = EngineStats()
    stats.record_step(2, prefill_tokens=10, decode_tokens=0, seconds=30.0, compiled=True)
    stats.record_step(2, prefill_tokens=6, decode_tokens=2, seconds=0.04)
    out = stats.as_dict()
    assert out["prefill_tokens"] == 16 and out["compile_steps"] == 1 and out["compile_time_s"] == 30.0
    assert out["prefill_time_s"] == pytest.approx(0.03) and out["prefill_tokens_per_s"] == pytest.approx(200.0)
    assert out["decode_tokens_per_s"] == pytest.approx(200.0)


@pytest.mark.parametrize(("unit", "tokens", "expected"), [
    ("page", 16, "peak 3 of 64 KV pages (16 tokens each, 25% of the held pages' room unused)"),
    ("slot", 2048, "peak 3 of 64 KV slots (2048 tokens each, reserved whole: 25% of the held slots' room unused)"),
])
def test_kv_usage_is_told_in_the_caches_own_unit(unit, tokens, expected):
    stats = EngineStats()
    stats.record_pages(3, 64, 1024, unit, tokens)
    stats.record_occupancy(4, 3)
    assert kv_usage_text(stats.as_dict()) == expected
