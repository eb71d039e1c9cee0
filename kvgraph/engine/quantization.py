"""Weight-only quantization of a model's linear layers, applied to the module before capture.

``EngineConfig(quantization="int8-weight-only")`` stores the weight of every ``nn.Linear`` as
int8 with one scale per output row (symmetric, per row: torchao's ``Int8WeightOnlyConfig``);
activations, embeddings, norms and the KV cache keep the model's dtype. The module is quantized
in place before ``kvgraph.compile`` sees it, so capture, the lowering passes and
``kvgraph::ragged_attention`` are the same as for the unquantized model: Dynamo traces through
torchao's weight subclass, AOTAutograd flattens it into its int8 data and scales (constants under
``freeze_weights``), and Inductor matches ``mm(x, int8 weight -> bfloat16) * scale`` onto its int8
weight-only matmul (``aten._weight_int8pack_mm``, reading one byte per weight).

That matmul takes bfloat16 activations only: with float32 (or float16) Inductor's freezing would
fold the int8 weights back into float32 constants, and without freezing each call would convert
every weight, so the other dtypes are refused (:data:`QUANTIZED_DTYPES`).

The vocabulary projection (``lm_head``) is quantized only with ``quantize_lm_head=True``: its
error reaches the logits directly, and with a tied embedding quantizing it unties the pair, which
keeps both copies.

Needs the ``quant`` extra (torchao).
"""

from __future__ import annotations

import torch
from torch import nn

from kvgraph.engine.loading import model_dtype
from kvgraph.errors import ConfigError, require_extra

QUANTIZATION_SCHEMES = ("int8-weight-only",)
"""The values of ``EngineConfig.quantization`` besides ``None`` (no quantization)."""
QUANTIZED_DTYPES = (torch.bfloat16,)
"""The model dtypes a quantized model runs in (the activations' dtype)."""


def check_quantization(scheme: object, dtype: torch.dtype | None, tensor_parallel_size: int) -> None:
    """``ConfigError`` unless ``scheme`` is ``None`` or one of :data:`QUANTIZATION_SCHEMES`, and a
    quantized model would run: in one of :data:`QUANTIZED_DTYPES` (when ``dtype`` is given; a model
    kept as loaded is checked by :func:`quantize`) and on one rank."""
    if scheme is None:
        return
    if scheme not in QUANTIZATION_SCHEMES:
        raise ConfigError(
            f"quantization must be None or one of {', '.join(map(repr, QUANTIZATION_SCHEMES))}, got {scheme!r}"
        )
    if dtype is not None:
        check_quantized_dtype(scheme, dtype)
    if tensor_parallel_size > 1:
        raise ConfigError(
            f"quantization={scheme!r} with tensor_parallel_size={tensor_parallel_size}: the tensor-parallel "
            f"split cannot shard quantized weights; quantization runs on 1 rank only"
        )


def check_quantized_dtype(scheme: str, dtype: torch.dtype) -> None:
    """``ConfigError`` unless a model in ``dtype`` can run quantized with ``scheme``."""
    if dtype not in QUANTIZED_DTYPES:
        allowed = ", ".join(str(d) for d in QUANTIZED_DTYPES)
        raise ConfigError(
            f"quantization={scheme!r} runs with dtype {allowed} only (the int8 weight-only matmul takes "
            f"bfloat16 activations), got {dtype}: pass dtype=torch.bfloat16 (--dtype bfloat16)"
        )


def quantize(model: nn.Module, scheme: str, *, lm_head: bool = False) -> nn.Module:
    """Quantize the weights of ``model``'s ``nn.Linear`` layers in place with ``scheme``; returns ``model``.

    ``lm_head``: the vocabulary projection (:func:`output_projection`) too. Raises
    ``MissingExtraError`` without torchao, and ``ConfigError`` for a model in a dtype
    :func:`check_quantized_dtype` refuses, with no ``nn.Linear`` to quantize (GPT-2's ``Conv1D``
    layers are not), or with ``lm_head`` and a projection that shares its weight with the input
    embedding (quantizing it would keep both copies).
    """
    check_quantization(scheme, None, 1)
    require_extra("quant", f"quantization={scheme!r}", "torchao")
    check_quantized_dtype(scheme, model_dtype(model))
    head = output_projection(model)
    if lm_head and head is not None and _tied(model, head):
        raise ConfigError(
            f"quantize_lm_head=True, but {type(model).__name__}'s vocabulary projection shares its weight with "
            f"the input embedding: quantizing it would keep a second copy; leave quantize_lm_head off"
        )
    chosen = [m for m in model.modules() if isinstance(m, nn.Linear) and (lm_head or m is not head)]
    if not chosen:
        raise ConfigError(
            f"quantization={scheme!r} found no nn.Linear layer to quantize in {type(model).__name__}"
            f"{'' if lm_head else ' besides its vocabulary projection'}"
        )
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    chosen_ids = {id(m) for m in chosen}
    # set_inductor_config=False: torchao's recommended settings would change Inductor's config for
    # every later compile in the process.
    quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False),
              filter_fn=lambda module, name: id(module) in chosen_ids)
    return model


def output_projection(model: nn.Module) -> nn.Module | None:
    """The vocabulary projection: a Hugging Face model's output embeddings, else an ``lm_head``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if head is not None else getattr(model, "lm_head", None)


def _tied(model: nn.Module, head: nn.Module) -> bool:
    """Whether ``head``'s weight is also the model's input embedding."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    return embedding is not None and getattr(embedding, "weight", None) is getattr(head, "weight", None)


def dequantized(model: nn.Module) -> nn.Module:
    """Make every quantized weight of ``model`` a plain parameter again, in place; returns ``model``.

    The values are those the quantized weight stands for (int8 times its scale): a copy made this
    way and cast to float64 is the exact model a quantized one rounds.
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if is_traceable_wrapper_subclass(p):
                setattr(module, name, nn.Parameter(p.dequantize(), requires_grad=False))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the module's parameters and buffers as stored: a quantized weight counts its int8
    data and its scales, a weight shared by two modules (tied embeddings) once."""
    tensors = (*model.parameters(), *model.buffers())
    return sum(inner.numel() * inner.element_size() for t in tensors for inner in _storage_tensors(t))


def _storage_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``: itself, or a tensor subclass's inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in _storage_tensors(getattr(t, name))]
