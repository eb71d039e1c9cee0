"""Weight-only quantization of a model's linear layers, applied to the module before capture.

``EngineConfig(quantization="int8-weight-only")`` stores the weight of every ``nn.Linear`` as
int8 with one scale per output row (symmetric, per row: torchao's ``Int8WeightOnlyConfig``
quantizes it); activations, embeddings, norms and the KV cache keep the model's dtype. The module
is quantized in place before ``kvgraph.compile`` sees it: each quantized layer becomes an
:class:`Int8WeightOnlyLinear` holding torchao's int8 data and scales as buffers (constants under
``freeze_weights``) and calling ``kvgraph::int8_weight_linear``
(:mod:`kvgraph.ops.int8_linear`), which picks its kernel by the row count of each call: ATen's
int8 matrix-vector kernel for a few rows, kvgraph's fused C++ kernel for a decode batch, one
bfloat16 GEMM over the weight dequantized for the call beyond that. Capture, the lowering passes and ``kvgraph::ragged_attention`` are the same as
for the unquantized model; ``prune_logits`` prunes a quantized vocabulary projection as a plain one.

The activations must be bfloat16 (:data:`QUANTIZED_DTYPES`): the fused kernel takes bfloat16, and
in float32 the per-call dequantization would write four bytes per weight, more than the float32
model reads.

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
from kvgraph.ops import int8_linear

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
    _replace_layers(model, lambda child: Int8WeightOnlyLinear.from_quantized(child) if id(child) in chosen_ids else None)
    return model


def _replace_layers(model: nn.Module, replacement) -> None:
    """Put ``replacement(child)`` in place of every submodule of ``model`` it returns a module for."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)


class Int8WeightOnlyLinear(nn.Module):
    """A linear layer with an int8 weight ``[out, in]`` and one float32 scale per output row:
    ``kvgraph::int8_weight_linear(x, weight_int8, weight_scale, bias)``, on the CPU as
    ``kvgraph_cpu::int8_weight_linear`` with ``routes`` (:func:`kvgraph.ops.int8_linear.cpu_routes`,
    read when the layer is made; ``None`` where kvgraph's C++ library cannot be built).

    ``weight`` gives the values the int8 data stands for (int8 times its scale), a new tensor in
    the activations' dtype at each access; the module itself keeps only the int8 data.
    """

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: nn.Parameter | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.dtype = dtype
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", weight_scale)
        # the scales in the activations' dtype, for ATen's int8 kernel (converted once, not per call)
        self.register_buffer("weight_scale_act", weight_scale.to(dtype))
        self.bias = bias
        self.routes = int8_linear.cpu_routes() if weight_int8.device.type == "cpu" else None

    @classmethod
    def from_quantized(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        """The layer of ``linear`` whose weight torchao's ``Int8WeightOnlyConfig`` quantized
        (an ``Int8Tensor``: int8 ``qdata``, per-row ``scale``, zero ``zero_point``)."""
        weight = linear.weight
        qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
        zero_point = getattr(weight, "zero_point", None)
        rows = linear.out_features
        if not (isinstance(qdata, torch.Tensor) and qdata.dtype == torch.int8 and isinstance(scale, torch.Tensor)
                and scale.numel() == rows and (zero_point is None or not zero_point.any())):
            raise ConfigError(
                f"torchao quantized {type(linear).__name__}'s weight as {type(weight).__name__}, not as int8 data "
                f"with one scale per output row and no zero point; this torchao version is not supported"
            )
        return cls(qdata.detach().contiguous(), scale.detach().reshape(rows).to(torch.float32).contiguous(),
                   linear.bias, weight.dtype)

    @property
    def weight(self) -> torch.Tensor:
        return (self.weight_int8.to(torch.float32) * self.weight_scale[:, None]).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear.int8_weight_linear(x, self.weight_int8, self.weight_scale, self.bias, self.routes,
                                              self.weight_scale_act)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


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
    """Make every quantized layer of ``model`` a plain ``nn.Linear`` again, in place; returns ``model``.

    The weights are the values the quantized ones stand for (int8 times its scale): a copy made
    this way and cast to float64 is the exact model a quantized one rounds.
    """

    def plain(child: nn.Module) -> nn.Linear | None:
        if not isinstance(child, Int8WeightOnlyLinear):
            return None
        linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                           device=child.weight_int8.device, dtype=child.dtype)
        linear.weight = nn.Parameter(child.weight, requires_grad=False)
        if child.bias is not None:
            linear.bias = child.bias
        return linear

    _replace_layers(model, plain)
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
