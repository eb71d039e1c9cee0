"""``benchmarks/attention.py --interpret-smoke`` end to end on the CPU: the JSON it prints, and the
bytes it counts for a float and an 8-bit cache (its timings mean nothing under the interpreter)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kv_cache_dtype, row_bytes, autotune", [("auto", 64 * 2, "1"), ("int8", 64 + 4, "0")])
def test_smoke_run_reports_every_row_with_the_caches_bytes(kv_cache_dtype, row_bytes, autotune):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVGRAPH_TRITON_AUTOTUNE": autotune}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--interpret-smoke",
                          "--kv-cache-dtype", kv_cache_dtype], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["kv_cache_dtype"] == kv_cache_dtype and report["smoke"] is True
    assert report["autotune"] is (autotune == "1")
    # --interpret-smoke: float16, 2 KV heads of 64; batches 1 and 3, contexts 16 and 40
    assert [(r["batch"], r["context"]) for r in report["decode"]] == [(1, 16), (1, 40), (3, 16), (3, 40)]
    for row in report["decode"]:
        assert row["kv_bytes"] == 2 * row["batch"] * row["context"] * 2 * row_bytes
        assert row["ms"] > 0
    assert [r["length"] for r in report["prefill"]] == [17, 33]
    assert all(r["max_abs_diff_vs_sdpa"] < 1e-2 for r in report["prefill"])
