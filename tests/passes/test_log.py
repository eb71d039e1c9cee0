"""Every pass logs what it matched and how long it took, on the ``kvgraph.passes`` logger."""

from __future__ import annotations

import logging
import re

from kvgraph.passes import lower
from kvgraph.passes.pipeline import PASSES


def test_each_pass_logs_its_match_and_time(llama_sdpa, caplog):
    with caplog.at_level(logging.INFO, logger="kvgraph.passes"):
        lower(llama_sdpa.fresh())
    lines = {r.getMessage().split(":")[0]: r.getMessage() for r in caplog.records if r.name == "kvgraph.passes"}
    assert set(PASSES) | {"pipeline"} <= set(lines)
    assert all(re.search(r"\(\d+\.\d ms\)$", line) for line in lines.values())
    assert "2 sites (sdpa+expand+reshape), Hkv=2, D=16" in lines["find_attention"]
    assert "kv_blocks: float32[" in lines["add_kv_inputs"]
    assert "layer_idx 0..1" in lines["lower_attention"]
    assert "pruned logits" in lines["prune_logits"]
