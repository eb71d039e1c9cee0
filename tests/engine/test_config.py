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
    ({"max_batch_tokens": 0}, "max_batch_tokens must be a positive int, got 0"),
    ({"tensor_parallel_size": True}, "tensor_parallel_size must be a positive int, got True"),
    ({"kv_cache_memory": 0}, "kv_cache_memory must be a positive int, got 0"),
    ({"compile": "tvm"}, "compile must be one of inductor, eager, got 'tvm'"),
    ({"freeze_weights": 1}, "freeze_weights must be a bool, got 1"),
    ({"dtype": torch.int8}, "dtype must be None or a floating torch.dtype"),
    ({"cache_strategy": "ring"}, "unknown cache strategy 'ring'"),
    ({"device": "tpu"}, "device 'tpu' is not a torch device"),
    ({"page_size": 0, "compile": "tvm"}, "page_size must be a positive int"),  # sizes are checked first
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
    with pytest.raises(ConfigError, match="num_steps must be a positive int, got -1"):
        dataclasses.replace(config, num_steps=-1)
