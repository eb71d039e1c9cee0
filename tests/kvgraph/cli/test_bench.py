import json


def test_bench_compares_with_both_hf_baselines_and_writes_json_and_png(kvgraph_cli, fast_flags, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    done = kvgraph_cli(
        "bench", "--model", "llama-tiny", "--workload", "mixed", "--requests", "4", "--max-new-tokens", "4",
        "--max-seq-len", "272", "--json", str(out), "--plot", str(png), *fast_flags,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["workload"] == "mixed" and report["requests"] == 4
    rows = {r["system"]: r for r in report["results"]}
    assert set(rows) == {"kvgraph", "hf-generate", "hf-generate-batch"}
    for row in rows.values():
        assert row["new_tokens"] == 16 and row["tokens_per_s"] > 0
        assert row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] is not None
    assert rows["kvgraph"]["speedup_vs_kvgraph"] == 1.0
    assert 0 < rows["kvgraph"]["kv_peak_bytes"] <= rows["kvgraph"]["kv_allocated_bytes"]
    assert rows["hf-generate"]["kv_waste"] > rows["kvgraph"]["kv_waste"]  # padding vs page slack
    assert all(a["identical"] == a["requests"] == 4 for a in report["agreement"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "greedy outputs vs hf-generate: 4/4 requests identical" in done.stdout
