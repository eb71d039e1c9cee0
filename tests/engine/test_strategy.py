"""The engine runs its model through the runner strategy it is handed, and refuses one whose number of
ranks is not the config's ``tensor_parallel_size``."""

import pytest
import torch

from kvgraph.engine import EngineConfig, SamplingParams
from kvgraph.engine.llm_engine import LLMEngine
from kvgraph.engine.runner import ModelRunner
from kvgraph.engine.strategy import SingleProcess
from kvgraph.errors import ConfigError

CONFIG = EngineConfig(max_batch_size=2, max_seq_len=32, compile="eager", progress=False)


class Recording(SingleProcess):
    """One process, noting what the engine asked of it."""

    def __init__(self) -> None:
        self.calls: list[object] = []

    def device(self, device):
        self.calls.append("device")
        return super().device(device)

    def shard(self, model, params, config):
        self.calls.append(("shard", params.n_kv_heads, config))
        return super().shard(model, params, config)

    def runner(self, compiled, manager, progress):
        self.calls.append(("runner", manager.params.n_kv_heads))
        return super().runner(compiled, manager, progress)

    def close(self) -> None:
        self.calls.append("close")


def test_the_engine_runs_through_the_strategy_it_is_handed():
    strategy = Recording()
    engine = LLMEngine("llama-tiny", CONFIG, strategy=strategy)
    (done,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.close()
    assert len(done.token_ids) == 2 and type(engine.runner) is ModelRunner
    assert strategy.calls == ["device", ("shard", 2, CONFIG), ("runner", 2), "close"]


@pytest.mark.parametrize("strategy", [None, SingleProcess()])
def test_a_strategy_for_another_number_of_ranks_is_refused(strategy):
    config = EngineConfig(tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2\b.*\b1 rank"):
        LLMEngine("llama-tiny", config, strategy=strategy)


def test_a_config_that_is_not_one_is_refused():
    with pytest.raises(ConfigError, match=r"EngineConfig.*\bdict\b"):
        LLMEngine("llama-tiny", {"page_size": 8})


@pytest.mark.parametrize(("fields", "applies"), [
    ({}, True),  # float32 on the CPU: unfrozen by default
    ({"precompile": False}, False),
    ({"compile": "eager"}, False),
    ({"freeze_weights": True}, False),  # frozen weights are constants inside the compiled graph
    # int8 weights: frozen (no precompile) unless every linear is kvgraph's int8 op
    ({"dtype": torch.bfloat16, "quantization": "int8-weight-only"}, False),
    ({"dtype": torch.bfloat16, "quantization": "int8-weight-only", "quantize_lm_head": True}, True),
])
def test_precompile_applies_with_inductor_unfrozen_weights_and_one_rank(fields, applies):
    config = EngineConfig(max_batch_size=2, max_seq_len=32, progress=False, device="cpu", **fields)
    engine = LLMEngine("llama-tiny", config)  # compiles nothing before the first step
    try:
        assert (engine.compiled.precompile is not None) is applies
    finally:
        engine.close()
