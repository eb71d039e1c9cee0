"""The continuous-batching engine (``kvgraph.engine.llm_engine.LLMEngine``), its ``EngineConfig``, and
the request types: ``SamplingParams``, ``Completion``, ``TokenEvent``, ``TokenLogprobs``.

Users build the engine as ``kvgraph.LLM`` (``kvgraph.entrypoints.llm``), which also picks its runner
strategy (one process, or tensor parallelism). This package imports only the light modules, so that
reading ``EngineConfig`` (the CLI does, for its flags) does not load the compiler stack.
"""

from kvgraph.engine.config import EngineConfig
from kvgraph.engine.requests import Completion, FinishReason, TokenEvent
from kvgraph.engine.sampling import SamplingParams, TokenLogprobs

__all__ = ["Completion", "EngineConfig", "FinishReason", "SamplingParams", "TokenEvent", "TokenLogprobs"]
