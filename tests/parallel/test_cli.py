"""``kvgraph generate`` and ``dump`` with ``--tensor-parallel-size 2`` (rank 1 spawned by the CLI)."""

import json
import subprocess
import sys

import pytest

from kvgraph.presets import load_preset
from tests.parallel.reference import greedy

pytestmark = pytest.mark.slow


def _kvgraph(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvgraph", *args], capture_output=True, text=True, timeout=400, check=False
    )


def test_generate_qwen2_continuous_equals_one_process():
    prompts = [[5, 6, 7, 8, 9], [30, 31, 32]]
    args = ["generate", "--model", "qwen2-tiny", "--cache", "continuous", "--tensor-parallel-size", "2",
            "--compile", "eager", "--max-batch-size", "2", "--max-seq-len", "32", "--max-new-tokens", "5",
            "--ignore-eos", "--json", "--no-progress"]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    done = _kvgraph(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    got = [c["token_ids"] for c in json.loads(done.stdout)["completions"]]
    model, _ = load_preset("qwen2-tiny")
    assert got == [greedy(model, p, 5) for p in prompts]


def test_dump_shows_rank_zero_graph_with_halved_heads_and_all_reduces():
    done = _kvgraph("dump", "--model", "llama-tiny", "--stage", "lowered", "--tensor-parallel-size", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "rank 0 of 2: 4 all-reduces (Partial -> Replicate)" in out  # 2 layers x (attention, MLP)
    assert "[total_num_pages, 2, 2, 16, 1, 16]" in out  # 1 of the 2 KV heads per rank
    assert "[s27, 2, 16]" in out  # ragged_attention over 2 of the 4 query heads


def test_dump_of_fused_qkv_gpt2_shows_halved_heads_and_its_all_reduces():
    done = _kvgraph("dump", "--model", "gpt2-tiny", "--stage", "lowered", "--tensor-parallel-size", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank 0 of 2: 4 all-reduces (Partial -> Replicate)" in done.stdout  # c_proj of attention and MLP
    assert "[total_num_pages, 2, 2, 16, 2, 16]" in done.stdout  # 2 of the 4 KV heads per rank


def test_generate_size_error_is_one_line():
    done = _kvgraph("generate", "--model", "llama-tiny", "--tensor-parallel-size", "3", "--compile", "eager")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        "kvgraph generate: error: tensor_parallel_size=3 does not divide"
    )
