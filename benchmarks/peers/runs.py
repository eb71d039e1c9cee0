"""What the peer runners share (stdlib only: they run in the peers' virtualenvs, without kvgraph):
the KV cache size to ask for, and the warm-up and timed run every runner does the same way."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

Generate = Callable[[object, list[list[int]], int], tuple[list[list[int]], float]]
"""``generate(engine, prompts, max_new_tokens) -> (outputs, seconds)``."""


def read_request(description: str) -> tuple[Path, dict]:
    """The runner's arguments: ``--model-dir`` and the request ``--request REQ.json`` holds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--request", type=Path, required=True)
    args = parser.parse_args()
    return args.model_dir, json.loads(args.request.read_text())


def kv_cache_gb(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, element_bytes: int,
                page_tokens: int) -> int:
    """Whole GB of KV cache for every request at its full length (``element_bytes`` a value), with
    a page of ``page_tokens`` per request for rounding and a quarter to spare."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * element_bytes
    tokens = sum(len(p) + max_new_tokens + page_tokens for p in prompts)
    return max(1, math.ceil(1.25 * tokens * per_token / 2**30))


def timed_run(generate: Generate, engine: object, prompts: list[list[int]], max_new_tokens: int,
              warm_runs: int) -> dict:
    """A warm-up like ``kvgraph.LLM.warmup`` (3 short requests), ``warm_runs`` untimed runs of the
    whole workload, then the timed one: the result's timing and output fields."""
    _, warm_a = generate(engine, [[0, 0, 0], [0, 0]], 3)
    _, warm_b = generate(engine, [[0, 0, 0]], 3)
    first_s = [generate(engine, prompts, max_new_tokens)[1] for _ in range(warm_runs)]
    outputs, wall_s = generate(engine, prompts, max_new_tokens)
    return {
        "warmup_s": round(warm_a + warm_b, 4), "wall_s": round(wall_s, 4),
        "untimed_runs_s": [round(t, 4) for t in first_s],
        "generated_tokens": [len(o) for o in outputs], "outputs": outputs,
    }
