"""The continuous-batching engine: ``LLM``, ``SamplingParams``, ``Completion``."""

from kvgraph.engine.llm_engine import LLM
from kvgraph.engine.requests import Completion, FinishReason, TokenEvent
from kvgraph.engine.sampling import SamplingParams

__all__ = ["LLM", "Completion", "FinishReason", "SamplingParams", "TokenEvent"]
