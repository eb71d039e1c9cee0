"""The engine's configuration: everything ``kvgraph.LLM`` takes besides the model and its tokenizer.

One frozen object, checked once when it is made: the engine, the CLI's engine flags and the ranks
of a tensor-parallel engine all read the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgraph.cache.params import KVCacheStrategy, check_positive_int, parse_device
from kvgraph.cache.quant import STORAGE_DTYPES
from kvgraph.engine.quantization import check_quantization
from kvgraph.errors import ConfigError

COMPILE_MODES = ("inductor", "eager")
"""What runs the lowered graph: Inductor, or the lowered FX graph as it is."""

KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
"""``kv_cache_dtype`` by name (the CLI's ``--kv-cache-dtype``): ``auto`` stores the model's dtype."""


@dataclass(frozen=True)
class EngineConfig:
    """How an engine caches, batches, compiles and places its model; every field checked at construction.

    Attributes:
        cache_strategy: ``"paged"`` or ``"continuous"`` (a ``KVCacheStrategy`` once made).
        page_size: tokens per page of a paged cache.
        max_batch_size: sequences per step.
        max_seq_len: the longest context, prompt and generated tokens together.
        max_batch_tokens: new tokens per step (prefills are chunked to fit).
        kv_cache_memory: bytes of the paged pool over all ranks; ``None``: room for
            ``max_batch_size`` sequences of ``max_seq_len`` tokens.
        enable_prefix_caching: share the pages of a common prompt prefix (paged cache only).
        num_steps: decode steps run back to back for a batch of decodes.
        compile: one of ``COMPILE_MODES``.
        freeze_weights: compile the weights in as constants (Inductor's freezing: constant
            folding, oneDNN linears with prepacked weights; Inductor only); later edits of the
            module's parameters are not guaranteed to be seen. ``None`` (the default): freeze
            unless kvgraph runs every linear layer itself anyway (a float32 model on the CPU with
            ``packed_linears`` and no weight quantization, or int8 weights with
            ``quantize_lm_head``), where freezing is no faster and keeps AOTAutograd from caching
            the compiled graphs (:func:`resolve_freeze_weights`).
        packed_linears: on the CPU, run float32 linear layers as ``kvgraph::linear``, the weight
            packed once for MKL's GEMM (``kvgraph.ops.linear``); ``False``: Inductor's own.
        cpp_wrapper: have Inductor write each graph's wrapper (what calls its kernels) in C++
            instead of Python (its ``cpp_wrapper``): a step's Python calls go, for a C++ compile
            of the wrapper when a graph is compiled (precompiled files keep it). ``None`` (the
            default): in C++ on the CPU (in Python, with a warning, for a graph whose C++ wrapper
            fails to compile), in Python on CUDA; ``KVGRAPH_CPP_WRAPPER`` overrides it. On the Zen 4 host of
            ``benchmarks/RESULTS.md``: batch-1 ``llama-tiny`` 1.12-1.23x, ``llama-56m`` fp32 at 32
            sequences 1.02-1.08x, batch-1 int8 ``llama-56m`` 1.07-1.17x once loaded.
        device: where the model runs (a ``torch.device`` once made); ``None``: CUDA when available,
            else the CPU.
        dtype: cast the model to this floating dtype; ``None``: as loaded.
        progress: show on stderr what the first call of each step shape is compiling.
        tensor_parallel_size: ranks the model's heads and MLP are split over.
        trust_remote_code: let a checkpoint directory run its own modelling code.
        adaptive_threads: on the CPU with one rank, run each step on the cores other processes
            leave free, from 1 up to ``torch.get_num_threads()`` when the engine is made
            (``kvgraph.engine.threads``), instead of a fixed count that stalls every layer while
            another process shares a core. The count is set past Dynamo's guards, so a new one
            re-traces nothing. On by default.
        quantization: store the linear layers' weights quantized before capture: ``None``, or one
            of ``kvgraph.engine.quantization.QUANTIZATION_SCHEMES`` (``"int8-weight-only"``: int8
            weights with a scale per row; needs ``dtype=torch.bfloat16``, one rank and the
            ``quant`` extra).
        quantize_lm_head: quantize the vocabulary projection too (with ``quantization`` only).
        kv_cache_dtype: store the KV cache quantized: ``torch.int8`` or ``torch.float8_e4m3fn``
            (or their names in ``KV_CACHE_DTYPES``), with a float32 scale per 128 elements of
            the head dimension (MAX's ``KVCacheQuantizationConfig()``; clamped to the head size,
            which it must then divide); read by the CPU kernels and the Triton kernels (CUDA; float8
            from compute capability 8.9). ``None``: the model's dtype.
        precompile: keep each compiled graph whole on disk (Dynamo's capture, guards and Inductor's
            code, ``kvgraph.compiler.precompiled``) and load it in a later engine of the same model and
            settings without tracing. Applies with Inductor, unfrozen weights (:func:`resolve_freeze_weights`)
            and one rank; elsewhere every start traces, with Inductor's own on-disk cache. On by default.
        background_compile: where ``precompile`` applies and this model and these settings have no
            precompiled files yet, serve at once with the lowered graph uncompiled (``compile="eager"``)
            while a worker process compiles it with Inductor and writes the files; the engine loads
            them at the first step after the worker is done (``kvgraph.engine.background_compile``).
            Elsewhere it changes nothing. Off by default (``kvgraph serve`` turns it on).

    Raises ``ConfigError`` naming the first field out of range, in the order above with
    the sizes first.
    """

    cache_strategy: KVCacheStrategy | str = "paged"
    page_size: int = 16
    max_batch_size: int = 64
    max_seq_len: int = 2048
    max_batch_tokens: int = 2048
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    num_steps: int = 1
    compile: str = "inductor"
    freeze_weights: bool | None = None
    packed_linears: bool = True
    cpp_wrapper: bool | None = None
    device: torch.device | str | None = None
    dtype: torch.dtype | None = None
    progress: bool = True
    tensor_parallel_size: int = 1
    trust_remote_code: bool = False
    adaptive_threads: bool = True
    quantization: str | None = None
    quantize_lm_head: bool = False
    kv_cache_dtype: torch.dtype | str | None = None
    precompile: bool = True
    background_compile: bool = False

    def __post_init__(self) -> None:
        for name in ("page_size", "max_batch_size", "max_seq_len", "max_batch_tokens", "num_steps",
                     "tensor_parallel_size"):
            check_positive_int(name, getattr(self, name))
        if self.kv_cache_memory is not None:
            check_positive_int("kv_cache_memory", self.kv_cache_memory)
        if self.compile not in COMPILE_MODES:
            raise ConfigError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.freeze_weights is not None:
            check_flags(freeze_weights=self.freeze_weights)
        if self.cpp_wrapper is not None:
            check_flags(cpp_wrapper=self.cpp_wrapper)
        check_flags(enable_prefix_caching=self.enable_prefix_caching, packed_linears=self.packed_linears,
                    trust_remote_code=self.trust_remote_code, adaptive_threads=self.adaptive_threads,
                    quantize_lm_head=self.quantize_lm_head, precompile=self.precompile,
                    background_compile=self.background_compile)
        check_dtype(self.dtype)
        check_quantization(self.quantization, self.dtype, self.tensor_parallel_size)
        if self.quantize_lm_head and self.quantization is None:
            raise ConfigError("quantize_lm_head=True needs a quantization scheme, got quantization=None")
        object.__setattr__(self, "cache_strategy", KVCacheStrategy.parse(self.cache_strategy))
        object.__setattr__(self, "device", resolve_device(self.device))
        object.__setattr__(self, "kv_cache_dtype", check_kv_cache_dtype(self.kv_cache_dtype, self.device))

    @property
    def kv_cache_memory_per_rank(self) -> int | None:
        """Each rank's share of ``kv_cache_memory`` (``None`` when that is)."""
        return None if self.kv_cache_memory is None else self.kv_cache_memory // self.tensor_parallel_size


def resolve_freeze_weights(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of ``dtype`` on ``device`` is compiled frozen: ``config.freeze_weights``, or
    when that is ``None``, unless kvgraph runs every linear layer itself on the CPU: a float32 model
    with ``packed_linears`` and no weight quantization, or weight quantization with the vocabulary
    projection quantized too (``quantize_lm_head``: every linear is ``kvgraph::int8_weight_linear``).
    There, frozen and unfrozen run at the same speed (``benchmarks/engine_ab.py --variants
    frozen,unfrozen``; ``benchmarks/quantization.py --variants int8+lm_head,int8+lm_head-frozen``),
    and only unfrozen graphs are cached whole by AOTAutograd and precompiled, which makes a second
    start of the int8 ``llama-56m`` 0.4 s instead of 19 s."""
    if config.freeze_weights is not None:
        return config.freeze_weights
    if device.type != "cpu":
        return True
    if config.quantization is not None:
        return not config.quantize_lm_head
    return not (dtype == torch.float32 and config.packed_linears)


def check_flags(**flags: object) -> None:
    """``ConfigError`` naming the first flag that is not a bool."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be a bool, got {value!r}")


def check_dtype(dtype: object) -> None:
    """``ConfigError`` unless ``dtype`` is ``None`` or a floating ``torch.dtype``."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"dtype must be None or a floating torch.dtype (torch.float16, ...), got {dtype!r}")


def check_kv_cache_dtype(kv_cache_dtype: object, device: torch.device) -> torch.dtype | None:
    """The storage dtype ``kv_cache_dtype`` names (``None``: the model's); ``ConfigError`` unless it is
    ``None``, a name of ``KV_CACHE_DTYPES`` or one of the 8-bit storage dtypes, and the device has
    a kernel that reads a quantized cache (``kvgraph.ops.attention.QUANTIZED_DEVICE_TYPES``)."""
    from kvgraph.ops.attention import QUANTIZED_DEVICE_TYPES

    if isinstance(kv_cache_dtype, str):
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        kv_cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    if kv_cache_dtype is None:
        return None
    if kv_cache_dtype not in STORAGE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype must be None or one of {[str(d) for d in STORAGE_DTYPES]}, got {kv_cache_dtype!r}"
        )
    if device.type not in QUANTIZED_DEVICE_TYPES:
        raise ConfigError(
            f"kv_cache_dtype={kv_cache_dtype} needs a device of type {' or '.join(QUANTIZED_DEVICE_TYPES)}: only "
            f"their kernels read a quantized cache, got device {device}"
        )
    return kv_cache_dtype


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` parsed (default: CUDA when available, else the CPU)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = parse_device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(device)!r} requested, but CUDA is not available")
    return device
