"""``kvgraph.LLM``: the engine as users build it, from keyword arguments or an ``EngineConfig``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from kvgraph.engine.config import EngineConfig
from kvgraph.engine.llm_engine import LLMEngine
from kvgraph.engine.strategy import RunnerStrategy, SingleProcess
from kvgraph.errors import ConfigError
from kvgraph.parallel.group import launched_rank
from kvgraph.parallel.tensor_parallel import TensorParallelStrategy, run_worker


class LLM(LLMEngine):
    """Generate text with continuous batching over a paged (or continuous) KV cache.

    ``LLM(model, tokenizer=None, **options)``: ``model`` is an ``nn.Module`` (a Hugging Face causal
    LM, or any module mapping ``input_ids [1, T]`` and ``position_ids [1, T]`` to logits), the name
    of a built-in preset, or the path of a local Hugging Face checkpoint directory (its tokenizer is
    loaded too when present). ``options`` are the fields of :class:`~kvgraph.engine.config.EngineConfig`,
    with its defaults: ``cache_strategy="paged"``, ``page_size=16``, ``max_batch_size=64``,
    ``max_seq_len=2048``, ``max_batch_tokens=2048``, ``kv_cache_memory=None`` (bytes of the paged
    pool; default: room for ``max_batch_size`` sequences of ``max_seq_len`` tokens),
    ``enable_prefix_caching=True``, ``num_steps=1``, ``compile="inductor"``, ``freeze_weights=None`` (auto),
    ``packed_linears=True``, ``device=None``, ``dtype=None``, ``progress=True``, ``tensor_parallel_size=1``,
    ``trust_remote_code=False``, ``adaptive_threads=True``, ``quantization=None`` (or
    ``"int8-weight-only"``: int8 linear weights, with ``dtype=torch.bfloat16``),
    ``quantize_lm_head=False``. ``config=EngineConfig(...)`` gives them as one object instead
    (``options`` given as well override its fields). Everything :class:`LLMEngine` offers works here.

    ``tensor_parallel_size=N`` splits the model's heads and MLP over ``N`` ranks (see
    ``kvgraph.parallel``): this process is rank 0 and spawns the others, unless a process group or
    ``torchrun`` already set the ranks up. ``kv_cache_memory`` is then over all ranks. On a rank
    other than 0 the constructor runs rank 0's steps (``kvgraph.parallel.run_worker``) and returns
    once rank 0 calls ``close``; the object it makes there only answers ``rank``, ``config`` and
    ``close``.
    """

    def __init__(
        self,
        model: torch.nn.Module | str | Path,
        *,
        tokenizer: object | None = None,
        config: EngineConfig | None = None,
        **options: object,
    ) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
        config = EngineConfig(**options) if config is None else replace(config, **options)
        self.rank = launched_rank() if config.tensor_parallel_size > 1 else 0
        if self.rank != 0:
            self.config = config
            run_worker(config, model)
            return
        super().__init__(model, config, tokenizer=tokenizer, strategy=_strategy(config))

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine and leave its group (nothing otherwise,
        nor on a rank other than 0, which left the group when rank 0 closed)."""
        if self.rank == 0:
            super().close()

    def __getattr__(self, name: str) -> object:
        """Reached only for an attribute this object lacks: on a rank other than 0 that is all of
        the engine's, which lives on rank 0."""
        if self.__dict__.get("rank", 0) == 0 or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise ConfigError(
            f"rank {self.rank} of {self.config.tensor_parallel_size} ran rank 0's steps; call generate on rank 0"
        )


def _strategy(config: EngineConfig) -> RunnerStrategy:
    """One process, or this process as rank 0 of ``config.tensor_parallel_size``."""
    if config.tensor_parallel_size == 1:
        return SingleProcess()
    return TensorParallelStrategy(config.tensor_parallel_size)
