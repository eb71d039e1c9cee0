"""``kvgraph.LLM``: keyword arguments or an ``EngineConfig`` make the engine's config, the strategy follows
``tensor_parallel_size``, and on a rank other than 0 ``run_worker`` runs instead of an engine."""

import pytest

from kvgraph.engine.config import EngineConfig
from kvgraph.engine.llm_engine import LLMEngine
from kvgraph.engine.strategy import SingleProcess
from kvgraph.entrypoints.llm import LLM
from kvgraph.errors import ConfigError
from kvgraph.parallel.tensor_parallel import TensorParallelStrategy
from tests.naming import raises_naming


@pytest.fixture
def engines(monkeypatch) -> list[tuple]:
    """``(model, config, tokenizer, strategy)`` of every engine built, none of them really built."""
    built = []

    def record(self, model, config, *, tokenizer, strategy) -> None:
        built.append((model, config, tokenizer, strategy))

    monkeypatch.setattr(LLMEngine, "__init__", record)
    return built


def test_keyword_arguments_make_the_config(engines):
    LLM("llama-tiny", tokenizer="tok", page_size=8, compile="eager")
    ((model, config, tokenizer, strategy),) = engines
    assert (model, tokenizer, config) == ("llama-tiny", "tok", EngineConfig(page_size=8, compile="eager"))
    assert isinstance(strategy, SingleProcess)


def test_keyword_arguments_override_a_given_config(engines):
    LLM("llama-tiny", config=EngineConfig(page_size=8), max_batch_size=4)
    assert engines[0][1] == EngineConfig(page_size=8, max_batch_size=4)


def test_a_config_that_is_not_one_is_refused():
    with pytest.raises(ConfigError, match=r"config.*\bdict\b"):
        LLM("llama-tiny", config={"page_size": 8})


def test_rank_zero_runs_the_tensor_parallel_strategy(engines, monkeypatch):
    monkeypatch.setattr("kvgraph.entrypoints.llm.launched_rank", lambda: 0)
    llm = LLM("llama-tiny", tensor_parallel_size=2)
    strategy = engines[0][3]
    assert isinstance(strategy, TensorParallelStrategy) and strategy.world_size == 2 and llm.rank == 0


def test_another_rank_runs_the_worker_and_builds_no_engine(engines, monkeypatch):
    served = []
    monkeypatch.setattr("kvgraph.entrypoints.llm.launched_rank", lambda: 1)
    monkeypatch.setattr("kvgraph.entrypoints.llm.run_worker", lambda config, model: served.append((config, model)))
    llm = LLM("llama-tiny", tensor_parallel_size=2, compile="eager")
    assert served == [(EngineConfig(tensor_parallel_size=2, compile="eager"), "llama-tiny")] and not engines
    assert llm.rank == 1
    llm.close()  # rank 0's close already stopped this rank
    with raises_naming(ConfigError, "rank 1 of 2", "rank 0's steps", "generate on rank 0"):

        llm.generate([[1, 2]])
