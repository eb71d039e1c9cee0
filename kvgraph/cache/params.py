"""KV cache parameters: strategy, layout sizes, byte counts (as MAX's ``KVCacheParams``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvgraph.cache.quant import KVCacheQuantizationConfig, check_storage
from kvgraph.errors import InvalidParamsError


class KVCacheStrategy(str, enum.Enum):
    """How the cache is laid out in memory."""

    CONTINUOUS = "continuous"
    """One contiguous ``max_seq_len`` slot per sequence."""
    PAGED = "paged"
    """Fixed-size pages from a shared pool, mapped through a lookup table."""
    MODEL_DEFAULT = "model_default"
    """The model's natural strategy; ``KVCacheParams`` resolves it to ``PAGED``."""

    @classmethod
    def parse(cls, value: KVCacheStrategy | str) -> KVCacheStrategy:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(s.value for s in cls)
            raise InvalidParamsError(
                f"unknown cache strategy {value!r}; expected one of {names}"
            ) from None

    @property
    def resolved(self) -> KVCacheStrategy:
        """The strategy a cache is built with: ``MODEL_DEFAULT`` is ``PAGED``."""
        return KVCacheStrategy.PAGED if self is KVCacheStrategy.MODEL_DEFAULT else self


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is a positive int, else ``InvalidParamsError`` naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidParamsError(f"{name} must be a positive int, got {value!r}")
    return value


def parse_device(device: object) -> torch.device:
    """``device`` as a ``torch.device``; ``InvalidParamsError`` naming it if it is not one."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidParamsError(f"device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None


@dataclass(frozen=True)
class KVCacheParams:
    """Static description of a KV cache.

    Unlike MAX, the layer count and the device live here too; a manager's ``num_layers`` and
    ``devices`` arguments, when given, must agree with them. ``cache_strategy=MODEL_DEFAULT``
    resolves to ``PAGED``. With ``n_devices > 1`` (tensor parallelism) each device holds
    ``n_kv_heads_per_device = n_kv_heads // n_devices`` heads of every token.

    As in MAX, ``dtype`` is what the cache stores: a floating dtype, or with
    ``kvcache_quant_config`` an 8-bit one (``torch.int8``, ``torch.float8_e4m3fn``) whose float32
    scales, one per ``scale_group`` elements of the head dimension, live in a second tensor
    (:mod:`kvgraph.cache.quant`).
    """

    dtype: torch.dtype
    n_kv_heads: int
    head_dim: int
    num_layers: int
    page_size: int | None = 16
    cache_strategy: KVCacheStrategy = KVCacheStrategy.PAGED
    enable_prefix_caching: bool = False
    device: torch.device | str = "cpu"
    n_devices: int = 1
    kvcache_quant_config: KVCacheQuantizationConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_strategy", KVCacheStrategy.parse(self.cache_strategy).resolved)
        object.__setattr__(self, "device", parse_device(self.device))
        check_storage(self.dtype, self.kvcache_quant_config)
        for name in ("n_kv_heads", "head_dim", "num_layers", "n_devices"):
            check_positive_int(name, getattr(self, name))
        if self.kvcache_quant_config is not None:
            self.kvcache_quant_config.group(self.head_dim)
        if self.n_kv_heads % self.n_devices:
            raise InvalidParamsError(
                f"n_kv_heads={self.n_kv_heads} does not split across n_devices={self.n_devices}"
            )
        if self.cache_strategy is KVCacheStrategy.PAGED:
            if self.page_size is None:
                raise InvalidParamsError("page_size is required for the PAGED strategy, got None")
            check_positive_int("page_size", self.page_size)
        elif self.enable_prefix_caching:
            raise InvalidParamsError(
                f"enable_prefix_caching=True needs cache_strategy=PAGED, got {self.cache_strategy.value}"
            )

    @property
    def n_kv_heads_per_device(self) -> int:
        """KV heads each device holds: ``n_kv_heads // n_devices``."""
        return self.n_kv_heads // self.n_devices

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def quantized(self) -> bool:
        """Whether the cache stores 8-bit K/V with scales (``kvcache_quant_config`` is set)."""
        return self.kvcache_quant_config is not None

    @property
    def scale_group(self) -> int | None:
        """Head-dim elements per scale (the granularity clamped to ``head_dim``); ``None`` unquantized."""
        config = self.kvcache_quant_config
        return None if config is None else config.group(self.head_dim)

    @property
    def scales_per_head(self) -> int:
        """Scales per token and head: ``head_dim // scale_group`` (0 unquantized)."""
        return 0 if self.scale_group is None else self.head_dim // self.scale_group

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V (and their scales) for one token over all layers (and all devices)."""
        config = self.kvcache_quant_config
        scale_bytes = 0 if config is None else self.scales_per_head * config.scale_dtype.itemsize
        return 2 * self.num_layers * self.n_kv_heads * (self.head_dim * self.dtype_bytes + scale_bytes)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: ``bytes_per_token * page_size`` (unquantized:
        ``2 * num_layers * n_kv_heads * head_dim * page_size * dtype_bytes``)."""
        if self.page_size is None:
            raise InvalidParamsError("page_bytes needs a page_size; this cache has none")
        return self.bytes_per_token * self.page_size

    @property
    def is_paged(self) -> bool:
        return self.cache_strategy is KVCacheStrategy.PAGED
