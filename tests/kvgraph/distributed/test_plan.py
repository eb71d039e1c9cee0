"""The sharding plan's checks: sizes that do not divide and fused projections fail before any work."""

import sys
from pathlib import Path

import pytest
import torch

import kvgraph
from kvgraph.distributed import ShardingPlan
from kvgraph.engine.loading import kv_params_from_config
from kvgraph.errors import InvalidParamsError
from kvgraph.presets import load_preset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from nanogpt_model import NanoGPT  # noqa: E402


def _params(model):
    return kv_params_from_config(
        model, cache_strategy="paged", page_size=4, enable_prefix_caching=False, device=torch.device("cpu")
    )


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
    with pytest.raises(InvalidParamsError, match=r"tensor_parallel_size=3 does not divide the model.s 4 query heads"):
        kvgraph.LLM(load_preset("llama-tiny")[0], tensor_parallel_size=3,
                    compile="eager", max_batch_size=2, max_seq_len=32)
    assert not torch.distributed.is_initialized()


def test_kv_heads_that_do_not_split_are_named():
    model, _ = load_preset("llama-tiny")  # 4 query / 2 KV heads
    with pytest.raises(InvalidParamsError, match=r"tensor_parallel_size=4 does not divide the model's 2 KV heads"):
        ShardingPlan.of(model, 4, _params(model))


def test_fused_qkv_is_refused_by_name():
    model, _ = load_preset("gpt2-tiny")
    params = _params(model)
    with pytest.raises(InvalidParamsError, match=r"cannot split 'transformer.h.0.attn.c_attn'"):
        ShardingPlan.of(model, 2, params)
    with pytest.raises(InvalidParamsError, match=r"cannot split 'h.0.attn.c_attn'"):
        ShardingPlan.of(NanoGPT(), 2, params)


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(InvalidParamsError, match="tensor_parallel_size must be a positive int, got 0"):
        kvgraph.LLM(load_preset("llama-tiny")[0], tensor_parallel_size=0)
