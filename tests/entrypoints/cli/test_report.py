import dataclasses

import pytest

from kvgraph.entrypoints.cli.baselines import SystemResult
from kvgraph.entrypoints.cli.report import (
    agreement,
    format_table,
    kv_memory_mib,
    percentile,
    summarize,
    summarize_floor,
    ttft_note,
)


def test_percentile_interpolates_linearly():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0


def test_summary_ratio_and_agreement():
    ref = SystemResult("kvgraph", [[1, 2, 3], [4, 5, 6]], 1.0, [0.1, 0.2], [0.01] * 4, 100, 50, 0.1)
    other = SystemResult("hf-generate", [[1, 2, 3], [4, 9, 6]], 2.0, [0.3, 0.3], [0.02] * 4)
    row = summarize(other, ref)
    assert row.tokens_per_s == 3.0 and row.speedup_vs_system == 2.0
    assert row.ttft_p50_ms == pytest.approx(300.0) and row.itl_p99_ms == pytest.approx(20.0)
    assert row.kv_peak_bytes is None
    assert agreement(ref, other) == {
        "system": "hf-generate", "identical": 1, "requests": 2, "first_mismatch": {"request": 1, "token": 1},
    }
    table = format_table([summarize(ref, ref), row])
    assert table.splitlines()[0].split()[:2] == ["system", "tok/s"]
    assert "n/a" in table.splitlines()[2]


def test_floor_row_counts_kvgraphs_tokens_and_has_no_latency_or_kv_figures():
    ref = SystemResult("kvgraph", [[1, 2, 3], [4, 5, 6]], 3.0, [0.1, 0.2], [0.01] * 4, 100, 50, 0.1)
    row = summarize_floor(0.5, ref)
    assert row.system == "matmul-floor" and row.requests == 2 and row.new_tokens == 6 and row.tokens_per_s == 12.0
    assert row.speedup_vs_system == pytest.approx(0.5 / 3.0)
    figures = {k: v for k, v in dataclasses.asdict(row).items() if k.startswith(("ttft", "itl", "kv_"))}
    assert list(figures.values()) == [None] * 9
    header, kvgraph, floor = format_table([summarize(ref, ref), row]).splitlines()
    assert "  speed-up vs system  " in header and "kvgraph speed-up" not in header
    assert kvgraph.split()[:3] == ["kvgraph", "2.0", "1.00x"]
    assert floor.split()[:3] == ["matmul-floor", "12.0", "0.167x"] and floor.split()[3:] == ["n/a"] * 8


def test_ttft_note_only_when_every_request_got_its_first_token_at_once():
    one_batch = SystemResult("hf-generate", [[1], [2], [3]], 1.0, [0.25] * 3, [])
    assert ttft_note(one_batch) == (
        "hf-generate: ttft p50 == p99 since all 3 requests ran in one batch and got their first token at the "
        "same moment"
    )
    assert ttft_note(SystemResult("kvgraph", [[1], [2]], 1.0, [0.1, 0.2], [])) is None
    assert ttft_note(SystemResult("kvgraph", [[1]], 1.0, [0.1], [])) is None


def test_kv_memory_sets_peak_against_peak_and_allocation_against_allocation():
    ref = SystemResult("kvgraph", [[1]], 1.0, [0.1], [], kv_allocated_bytes=4 * 2**20, kv_peak_bytes=2**20)
    batch = SystemResult("hf-generate-batch", [[1]], 1.0, [0.1], [], kv_allocated_bytes=8 * 2**20)
    rows = [summarize(ref, ref), summarize(batch, ref)]
    assert kv_memory_mib(rows) == {"peak held": [1.0, None], "allocated": [4.0, 8.0]}
