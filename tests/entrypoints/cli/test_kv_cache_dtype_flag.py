"""``--kv-cache-dtype`` on the commands that run a model: the dump shows the scales as a typed KV
input, and generation runs over the quantized cache."""

import json

import pytest


def test_dump_shows_the_int8_blocks_and_their_scales(kvgraph_cli):
    done = kvgraph_cli("dump", "--model", "llama-tiny", "--stage", "lowered", "--kv-cache-dtype", "int8")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("kv_")}
    # llama-tiny: 2 layers, page_size 16, 2 KV heads of 16: one scale per head and token
    assert "kv        int8     [total_num_pages, 2, 2, 16, 2, 16]" in rows["kv_blocks"]
    assert "kv        float32  [total_num_pages, 2, 2, 16, 2, 1]" in rows["kv_scales"]
    assert done.stdout.count("kvgraph::ragged_attention") == 2


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_generate_runs_over_the_quantized_cache(kvgraph_cli, fast_flags, dtype):
    done = kvgraph_cli(
        "generate", "--model", "llama-tiny", "--prompt", "Hello", "--max-new-tokens", "5", "--ignore-eos",
        "--max-seq-len", "64", "--json", "--kv-cache-dtype", dtype, *fast_flags,
    )
    assert done.returncode == 0, done.stderr
    (completion,) = json.loads(done.stdout)["completions"]
    assert len(completion["token_ids"]) == 5


def test_an_unknown_kv_cache_dtype_is_a_usage_error(kvgraph_cli):
    done = kvgraph_cli("generate", "--model", "llama-tiny", "--prompt", "Hi", "--kv-cache-dtype", "int4")
    assert done.returncode == 2 and "--kv-cache-dtype" in done.stderr and "int4" in done.stderr
