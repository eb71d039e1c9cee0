"""The sharding plan: what it splits, the fused-QKV rewrite of one rank's attention, and the sizes and
fused projections it refuses before any work."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

import kvgraph
from kvgraph.engine.loading import kv_params_from_config, traced_kv_params
from kvgraph.errors import ConfigError, LoweringError
from kvgraph.parallel import ShardingPlan
from kvgraph.parallel.fused import shard_attention, split_in
from kvgraph.presets import load_preset
from tests.naming import raises_naming
from tests.nanogpt_model import CausalSelfAttention, NanoGPT

KW = dict(cache_strategy="paged", page_size=4, enable_prefix_caching=False, device=torch.device("cpu"))


def _params(model):
    return kv_params_from_config(model, **KW)


def test_plan_splits_attention_and_mlp_of_llama():
    model, _ = load_preset("llama-tiny")
    plan = ShardingPlan.of(model, 2, _params(model))
    assert sorted(name.rsplit(".", 1)[1] for name in plan.colwise) == sorted(
        ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"] * 2
    )
    assert sorted(name.rsplit(".", 1)[1] for name in plan.rowwise) == ["down_proj"] * 2 + ["o_proj"] * 2
    assert (plan.n_heads, plan.n_kv_heads) == (4, 2)
    local = plan.local_params(_params(model), torch.device("cpu"))
    assert local.n_kv_heads == 1 and local.page_bytes * 2 == _params(model).page_bytes


def test_size_that_does_not_divide_the_heads_fails_before_any_process_starts():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3\b.*\b4 query heads"):
        kvgraph.LLM(load_preset("llama-tiny")[0], tensor_parallel_size=3,
                    compile="eager", max_batch_size=2, max_seq_len=32)
    assert not torch.distributed.is_initialized()


def test_kv_heads_that_do_not_split_are_named():
    model, _ = load_preset("llama-tiny")  # 4 query / 2 KV heads
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4\b.*\b2 KV heads"):
        ShardingPlan.of(model, 4, _params(model))


def test_plan_of_fused_qkv_models_regroups_c_attn_and_splits_the_mlp():
    nano = NanoGPT()
    plan = ShardingPlan.of(nano, 2, traced_kv_params(nano, **KW))
    assert plan.fused == ("h.0.attn", "h.1.attn")
    assert plan.colwise == ("h.0.mlp.0", "h.1.mlp.0")
    assert plan.rowwise == ("h.0.attn.c_proj", "h.0.mlp.2", "h.1.attn.c_proj", "h.1.mlp.2")
    gpt2, _ = load_preset("gpt2-tiny")
    plan = ShardingPlan.of(gpt2, 2, _params(gpt2))
    assert len(plan.fused) == 2 and (plan.n_heads, plan.n_kv_heads) == (4, 4)
    assert plan.colwise == ("transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc")


def test_per_rank_attention_of_two_ranks_sums_to_the_whole():
    """Each rank's regrouped c_attn, rewritten sizes and input-split c_proj; the all-reduce is the sum."""
    attn = NanoGPT(n_embd=48, n_head=6, block_size=16, seed=1).h[0].attn
    x = torch.randn(1, 11, 48, generator=torch.Generator().manual_seed(0))
    parts = []
    for rank in range(2):
        mine = copy.deepcopy(attn)
        local = shard_attention(mine, "h.0.attn", rank, 2)
        split_in(mine.c_proj, rank, 2)
        assert mine.c_attn.weight.shape == (72, 48) and mine.c_proj.weight.shape == (48, 24)
        with torch.no_grad():
            parts.append(local(x))
    with torch.no_grad():
        torch.testing.assert_close(parts[0] + parts[1], attn(x))


class ChunkedAttention(CausalSelfAttention):
    """Splits the fused output with ``chunk``: a form the rewrite does not know."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        y = F.scaled_dot_product_attention(*(t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v)))
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def test_fused_attention_the_rewrite_does_not_match_is_refused_by_node():
    model = NanoGPT()
    model.h[1].attn = ChunkedAttention(32, 4, 32)
    with raises_naming(LoweringError, "split 'h.1.attn'", "node c_attn", "not split once"):
        ShardingPlan.of(model, 2, traced_kv_params(NanoGPT(), **KW))


def test_other_fused_projections_are_refused_by_name():
    config = GPTNeoXConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                           vocab_size=64)
    model = GPTNeoXForCausalLM(config)
    with raises_naming(LoweringError, "split 'gpt_neox.layers.0.attention.query_key_value'"):

        ShardingPlan.of(model, 2, _params(model))


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size.*\b0\b"):
        kvgraph.LLM(load_preset("llama-tiny")[0], tensor_parallel_size=0)
