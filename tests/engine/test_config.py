"""``EngineConfig``: checked once when made, normalised, frozen."""

import dataclasses

import pytest
import torch

from kvgraph.cache.params import KVCacheStrategy
from kvgraph.engine.config import EngineConfig
from kvgraph.errors import ConfigError


def test_defaults_are_normalised():
    config = EngineConfig()
    assert config.cache_strategy is KVCacheStrategy.PAGED
    assert config.device == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert config.kv_cache_memory_per_rank is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_batch_tokens": 0}, r"max_batch_tokens.*\b0\b"),
    ({"tensor_parallel_size": True}, r"tensor_parallel_size.*\bTrue\b"),
    ({"kv_cache_memory": 0}, r"kv_cache_memory.*\b0\b"),
    ({"compile": "tvm"}, r"compile.*inductor, eager.*\'tvm\'"),
    ({"freeze_weights": 1}, r"freeze_weights.*\b1\b"),
    ({"precompile": "yes"}, r"precompile.*'yes'"),
    ({"cpp_wrapper": "auto"}, r"cpp_wrapper.*'auto'"),
    ({"dtype": torch.int8}, r"dtype.*torch\.int8"),
    ({"cache_strategy": "ring"}, "'ring'"),
    ({"device": "tpu"}, "device 'tpu'"),
    ({"page_size": 0, "compile": "tvm"}, r"page_size.*\b0\b"),  # sizes are checked first
])
def test_a_field_out_of_range_is_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**fields)


def test_frozen_and_replace_checks_again():
    config = EngineConfig(kv_cache_memory=1000, tensor_parallel_size=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.page_size = 8
    assert config.kv_cache_memory_per_rank == 333
    assert dataclasses.replace(config, cache_strategy="continuous").cache_strategy is KVCacheStrategy.CONTINUOUS
    with pytest.raises(ConfigError, match=r"num_steps.*-1\b"):
        dataclasses.replace(config, num_steps=-1)


@pytest.mark.parametrize("fields, dtype, device, frozen", [
    ({}, torch.float32, "cpu", False),  # kvgraph packs every linear: freezing buys nothing
    ({}, torch.bfloat16, "cpu", True),  # Inductor's bf16 linears need the weights frozen to pack
    ({}, torch.float32, "cuda", True),
    ({"packed_linears": False}, torch.float32, "cpu", True),
    ({"freeze_weights": True}, torch.float32, "cpu", True),
    ({"freeze_weights": False}, torch.bfloat16, "cpu", False),
])
def test_freeze_weights_auto(fields, dtype, device, frozen):
    from kvgraph.engine.config import resolve_freeze_weights

    config = EngineConfig(device="cpu", **fields)
    assert resolve_freeze_weights(config, dtype, torch.device(device)) is frozen


@pytest.mark.parametrize("lm_head, frozen", [
    (False, True),  # the vocabulary projection stays an Inductor bf16 linear, packed when frozen
    (True, False),  # every linear is kvgraph's int8 op: unfrozen, so the graphs are precompiled
])
def test_quantized_weights_are_frozen_unless_every_linear_is_quantized(lm_head, frozen):
    from kvgraph.engine.config import resolve_freeze_weights

    config = EngineConfig(device="cpu", dtype=torch.bfloat16, quantization="int8-weight-only",
                          quantize_lm_head=lm_head)
    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_freeze_weights(config, dtype, torch.device("cpu")) is frozen
    assert resolve_freeze_weights(dataclasses.replace(config, freeze_weights=not frozen), torch.bfloat16,
                                  torch.device("cpu")) is not frozen
    assert resolve_freeze_weights(config, torch.bfloat16, torch.device("cuda")) is True  # measured on the CPU only
