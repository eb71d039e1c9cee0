"""``benchmarks/pool_populate.py`` end to end on a tiny model: each pair runs one process per mapping
mode, and the JSON carries both processes' figures and their ratios (the timings themselves mean
little on a shared test machine)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_pair_reports_both_modes_and_their_ratios(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pool_populate.py"), "--model", "llama-tiny",
                          "--workloads", "decode-heavy", "--pairs", "1"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    result = report["results"]["decode-heavy"]
    (pair,) = result["pairs"]
    assert set(pair) == {"lazy", "eager"}
    for mode in pair.values():
        assert mode["ready_s"] > 0 and mode["run_s"] > 0
    assert result["run_lazy_over_eager"] == [round(pair["lazy"]["run_s"] / pair["eager"]["run_s"], 3)]
    assert result["median_ready_ratio"] == result["ready_lazy_over_eager"][0]
