"""Tiny Hugging Face decoders with seeded random weights (float32, eval mode): no downloads.

``tiny_llama()`` (GQA, RoPE), ``tiny_gpt2()`` (learned positions, MHA, fused qkv) and
``tiny_qwen2()`` (GQA with q/k/v biases) are plain functions taking config overrides;
``tests/models/conftest.py`` offers them as fixtures of the same names. ``ragged_decode``
drives a compiled model through a manager (prefill together, then decode together);
``reference_greedy`` is the model's own ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgraph import KVCacheParams, KVRequest, load_kv_manager
from kvgraph.compiler.step import run_step

VOCAB = 128
SEED = 0


# No BOS/EOS (generation runs every step it is asked for); weights larger than HF's default
# so that greedy choices are rarely near-ties.
COMMON = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.25, attn_implementation="sdpa")


def _build(model_cls, config, seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.bos_token_id = model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.float().eval()


def tiny_llama(seed: int = SEED, **overrides) -> torch.nn.Module:
    """``LlamaForCausalLM``: 2 layers, hidden 64, 4 query heads over 2 KV heads (head_dim 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    return _build(LlamaForCausalLM, LlamaConfig(**{**COMMON, **config, **overrides}), seed)


def tiny_gpt2(seed: int = SEED, **overrides) -> torch.nn.Module:
    """``GPT2LMHeadModel``: 2 layers, n_embd 64, 4 heads (head_dim 16), 256 positions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = dict(
        vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4,
    )
    return _build(GPT2LMHeadModel, GPT2Config(**{**COMMON, **config, **overrides}), seed)


def tiny_qwen2(seed: int = SEED, **overrides) -> torch.nn.Module:
    """``Qwen2ForCausalLM``: 2 layers, hidden 64, 4 query heads over 2 KV heads, q/k/v biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    return _build(Qwen2ForCausalLM, Qwen2Config(**{**COMMON, **config, **overrides}), seed)


def kv_params(model: torch.nn.Module, strategy: str, page_size: int | None = 4) -> KVCacheParams:
    """Cache parameters of a Hugging Face ``model`` from its config."""
    cfg = model.config
    heads = cfg.num_attention_heads
    return KVCacheParams(
        dtype=torch.float32, n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=cfg.hidden_size // heads, num_layers=cfg.num_hidden_layers,
        page_size=page_size if strategy == "paged" else None, cache_strategy=strategy,
    )


def make_manager(params: KVCacheParams, max_batch_size: int = 8, max_seq_len: int = 96):
    """A manager of ``params.cache_strategy`` (paged pools hold every sequence at full length)."""
    return load_kv_manager(params, max_batch_size, max_seq_len)


@dataclass
class Decoded:
    """Tokens chosen per sequence and the next-token logits of every step ``[batch, V]``."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]


def ragged_decode(
    compiled, manager, prompts: list[list[int]], steps: int, forced: list[list[int]] | None = None
) -> Decoded:
    """Prefill all ``prompts`` in one ragged step, then ``steps`` decode steps of the whole batch.

    ``compiled`` returns logits ``[1, batch, V]`` or an object holding them as ``.logits``.
    Greedy; with ``forced`` (per sequence, at least ``steps`` tokens) each decode step feeds
    ``forced[b][step]`` instead (teacher forcing). Releases the sequences at the end.
    """
    ids = manager.claim(len(prompts))
    new = [list(p) for p in prompts]
    out = Decoded([[] for _ in prompts], [])
    try:
        for step in range(steps + 1):
            batch = [KVRequest(i, tokens) for i, tokens in zip(ids, new, strict=True)]
            with torch.no_grad():
                result = run_step(compiled, manager, batch)
            logits = (result if isinstance(result, torch.Tensor) else result.logits)[0]  # [batch, V]
            out.logits.append(logits)
            chosen = logits.argmax(-1).tolist()
            for b, t in enumerate(chosen):
                out.tokens[b].append(t)
            if forced is not None and step < steps:
                chosen = [f[step] for f in forced]
            new = [[t] for t in chosen]
    finally:
        for i in ids:
            manager.release(i)
    return out


def reference_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> Decoded:
    """The model's own ``generate(do_sample=False)``: tokens and per-step logits ``[new_tokens, V]``."""
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
    return Decoded([gen.sequences[0, len(prompt):].tolist()], [torch.cat(gen.logits)])
