"""Hugging Face specifics of compiled models: their own KV cache is replaced by kvgraph's."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from kvgraph.errors import LoweringError


def takes_use_cache(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` accepts a ``use_cache`` argument (Hugging Face causal LMs do)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "use_cache" in params


def without_hf_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``use_cache=False`` unless the caller chose: kvgraph's cache replaces the model's.

    A caller's ``use_cache=True`` is kept; the backend then refuses the graph, whose outputs
    would carry the model's own per-layer keys and values (:func:`refuse_own_cache`).
    """
    if "use_cache" in kwargs:
        return kwargs
    return {**kwargs, "use_cache": False}


def refuse_own_cache(gm: torch.fx.GraphModule, sites: Sequence) -> None:
    """Raise ``LoweringError`` if the lowered graph returns keys or values of its attention sites.

    A model that keeps its own KV cache (Hugging Face with ``use_cache=True``) returns each
    layer's keys and values next to the logits. Lowered, those would hold only this step's
    new tokens (the history lives in kvgraph's cache), a cache that looks right and is not.

    Args:
        gm: the lowered graph.
        sites: its ``AttentionSite`` records (``k``/``v``: the ``[1, Hkv, T, D]`` nodes).
    """
    op = torch.ops.kvgraph.ragged_attention.default
    seen: set[torch.fx.Node] = set()
    frontier = [node for site in sites for node in (site.k, site.v)]
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "output":
            raise LoweringError(
                "the graph returns its attention keys/values (the model's own KV cache, e.g. a Hugging Face "
                "model called with use_cache=True); kvgraph's cache replaces it: call the model with "
                "use_cache=False"
            )
        frontier.extend(user for user in node.users if not (user.op == "call_function" and user.target is op))


def config_windows(model: torch.nn.Module) -> tuple[int | None, ...] | None:
    """Each layer's sliding window (keys a token sees, itself included; ``None``: plain causal) as a
    Hugging Face config states it, or ``None`` where the config does not say.

    ``layer_types`` (Qwen2, Gemma 2/3: ``"sliding_attention"`` or ``"full_attention"`` per layer)
    with ``sliding_window``, else ``sliding_window`` for every layer (Mistral; ``None``: no window).
    A config with neither attribute (Llama, GPT-2), or another layer type, states nothing: the
    windows are then learnt from the model's graph of several tokens.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return None
    config = config.get_text_config()
    layers = getattr(config, "num_hidden_layers", None)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not isinstance(layers, int) or (window is not None and not isinstance(window, int)):
        return None
    if types is not None:
        per_type = {"sliding_attention": window, "full_attention": None}
        if len(types) != layers or not set(types) <= set(per_type) or ("sliding_attention" in types and window is None):
            return None
        return tuple(per_type[t] for t in types)
    if not hasattr(config, "sliding_window"):
        return None
    return (window,) * layers
