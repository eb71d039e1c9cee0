"""KV cache parameters: strategy, layout sizes, byte counts (as MAX's ``KVCacheParams``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvgraph.errors import InvalidParamsError


class KVCacheStrategy(str, enum.Enum):
    """How the cache is laid out in memory."""

    CONTINUOUS = "continuous"
    """One contiguous ``max_seq_len`` slot per sequence."""
    PAGED = "paged"
    """Fixed-size pages from a shared pool, mapped through a lookup table."""

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


def parse_device(device: object) -> torch.device:
    """``device`` as a ``torch.device``; ``InvalidParamsError`` naming it if it is not one."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidParamsError(f"device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None


@dataclass(frozen=True)
class KVCacheParams:
    """Static description of a KV cache.

    Unlike MAX, the layer count lives here, so a manager is built as
    ``Manager(params, max_batch_size, max_seq_len, ...)``.
    """

    dtype: torch.dtype
    n_kv_heads: int
    head_dim: int
    num_layers: int
    page_size: int | None = 16
    cache_strategy: KVCacheStrategy = KVCacheStrategy.PAGED
    enable_prefix_caching: bool = False
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_strategy", KVCacheStrategy.parse(self.cache_strategy))
        object.__setattr__(self, "device", parse_device(self.device))
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise InvalidParamsError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")
        for name in ("n_kv_heads", "head_dim", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidParamsError(f"{name} must be a positive int, got {value!r}")
        if self.cache_strategy is KVCacheStrategy.PAGED:
            if self.page_size is None:
                raise InvalidParamsError("page_size is required for the PAGED strategy, got None")
            if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size <= 0:
                raise InvalidParamsError(f"page_size must be a positive int, got {self.page_size!r}")
        elif self.enable_prefix_caching:
            raise InvalidParamsError(
                f"enable_prefix_caching=True needs cache_strategy=PAGED, got {self.cache_strategy.value}"
            )

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: ``2 * num_layers * n_kv_heads * head_dim * page_size * dtype_bytes``."""
        if self.page_size is None:
            raise InvalidParamsError("page_bytes needs a page_size; this cache has none")
        return self.bytes_per_token * self.page_size

    @property
    def is_paged(self) -> bool:
        return self.cache_strategy is KVCacheStrategy.PAGED
