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
    assert set(rows) == {"kvgraph", "hf-generate", "hf-generate-batch", "matmul-floor"}
    floor = rows.pop("matmul-floor")
    for row in rows.values():
        assert row["new_tokens"] == 16 and row["tokens_per_s"] > 0
        assert row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] is not None
    assert rows["kvgraph"]["speedup_vs_system"] == 1.0
    assert floor["new_tokens"] == 16 and floor["ttft_p50_ms"] is None and floor["kv_peak_bytes"] is None
    assert report["kvgraph_vs_floor"] == rows["kvgraph"]["elapsed_s"] / floor["elapsed_s"]
    assert report["torch_threads"] >= 1 and report["dtype"] == "torch.float32"
    assert [a["system"] for a in report["agreement"]] == ["hf-generate", "hf-generate-batch"]
    assert 0 < rows["kvgraph"]["kv_peak_bytes"] <= rows["kvgraph"]["kv_allocated_bytes"]
    assert rows["hf-generate"]["kv_waste"] > rows["kvgraph"]["kv_waste"]  # padding vs page slack
    assert all(a["identical"] == a["requests"] == 4 for a in report["agreement"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "greedy outputs vs hf-generate: 4/4 requests identical" in done.stdout
    assert "x the matmul floor (floor " in done.stdout
    compute = report["compute"]
    assert compute["workload_gflop"] > compute["linear_gflop"] > 0 and compute["gemm_peak_gflops"] > 0
    for system, row in rows.items():
        achieved = compute["systems"][system]["gflops"]
        assert abs(achieved - compute["workload_gflop"] / row["elapsed_s"]) < 1e-6 * achieved
        assert f"{system}: {achieved:.1f} GFLOP/s achieved" in done.stdout
    assert "speed-up vs system: kvgraph's tokens/s / the system's" in done.stdout
    # 4 requests, --max-batch-size 4: HF's padded generate runs them as one batch
    note = "hf-generate: ttft p50 == p99 since all 4 requests ran in one batch"
    assert note in done.stdout and any(n.startswith(note) for n in report["notes"])
    assert report["kvgraph_stats"]["warmup_graphs"] == 2 and report["kvgraph_stats"]["recompiles"] == 0
    assert "2 graphs compiled in warm-up, 0 recompiles after it" in done.stderr


def test_bench_no_floor_leaves_out_the_floor_row(kvgraph_cli, fast_flags, tmp_path):
    out = tmp_path / "bench.json"
    done = kvgraph_cli(
        "bench", "--model", "llama-tiny", "--workload", "decode-heavy", "--requests", "2", "--max-new-tokens", "2",
        "--max-seq-len", "272", "--baselines", "none", "--no-floor", "--json", str(out), "--threads", "1", *fast_flags,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["torch_threads"] == 1  # --threads
    assert report["kvgraph_stats"]["others_cores"] is None  # one thread: nothing for a governor to take away
    assert [r["system"] for r in report["results"]] == ["kvgraph"]
    assert report["kvgraph_vs_floor"] is None and "matmul floor" not in done.stdout
