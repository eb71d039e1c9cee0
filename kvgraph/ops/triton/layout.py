"""How the Triton kernels address one layer of the KV cache.

Both cache strategies are presented to the kernels as a paged cache:

- paged: ``kv_blocks [total_num_pages, 2, num_layers, page_size, Hkv, D]`` with
  ``lookup_table [batch, max_num_pages]`` (``[b, logical_page] -> physical_page``);
- continuous: ``kv_blocks [max_batch_size, 2, num_layers, max_seq_len, Hkv, D]`` with
  ``lookup_table [batch]`` (``b -> slot``) is a paged cache whose page is a whole slot
  (``page_size = max_seq_len``) and whose lookup table has one column, read with a
  page stride of 0, so nothing is copied.

A position ``pos`` of sequence ``b`` lives at
``layer + page * stride_page + kv * stride_kv + (pos % page_size) * stride_row + head * stride_head``
with ``page = lookup[b * stride_lut_b + (pos // page_size) * stride_lut_p]`` and ``kv`` 0 for
keys, 1 for values; the head dim has stride 1.

A quantized cache (int8 or float8_e4m3fn ``kv_blocks`` with float32 ``kv_scales``, see
:mod:`kvgraph.cache.quant`) passes its scales the same way: ``kv_scales`` has ``kv_blocks``' layout
with ``head_dim // group`` values per row, and its own strides. A floating cache passes its own
layer and zero strides in their place, which its kernels never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgraph.cache.quant import QMAX

MIN_DOT = 16  # smallest tl.dot operand dim on GPUs


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """``head_dim`` rounded up to a power of two, at least 16 (the smallest ``tl.dot`` operand)."""
    return max(MIN_DOT, next_power_of_2(head_dim))


@dataclass(frozen=True)
class PagedLayer:
    """One layer of the cache as the kernels see it: a view and its strides, no copies.

    Attributes:
        layer: ``kv_blocks[:, :, layer_idx]``: ``[num_pages, 2, page_size, Hkv, D]``, a view.
        lookup: ``int32`` lookup table, ``[batch, max_num_pages]`` or ``[batch]`` (continuous).
        page_size: rows per page (``max_seq_len`` for the continuous strategy).
        num_pages: physical pages (slots); lookup entries ``>= num_pages`` mark unused pages.
        scales: ``kv_scales[:, :, layer_idx]`` of a quantized cache (``[num_pages, 2, page_size,
            Hkv, D // group]``, a view), else ``None``.
    """

    layer: torch.Tensor
    lookup: torch.Tensor
    page_size: int
    num_pages: int
    scales: torch.Tensor | None = None

    @classmethod
    def of(cls, kv_blocks: torch.Tensor, lookup_table: torch.Tensor, layer_idx: int,
           kv_scales: torch.Tensor | None = None) -> PagedLayer:
        """View layer ``layer_idx`` of ``kv_blocks`` (either strategy, told apart by the lookup rank)
        and of ``kv_scales`` for a quantized cache."""
        return cls(
            layer=kv_blocks.select(2, layer_idx),
            lookup=lookup_table,
            page_size=kv_blocks.shape[3],
            num_pages=kv_blocks.shape[0],
            scales=None if kv_scales is None else kv_scales.select(2, layer_idx),
        )

    @property
    def lookup_strides(self) -> tuple[int, int]:
        """``(stride_lut_b, stride_lut_p)``; the page stride is 0 for a continuous cache."""
        if self.lookup.dim() == 2:
            return self.lookup.stride(0), self.lookup.stride(1)
        return self.lookup.stride(0), 0

    @property
    def cache_strides(self) -> tuple[int, int, int, int]:
        """``(stride_page, stride_kv, stride_row, stride_head)`` of :attr:`layer`."""
        s = self.layer.stride()
        return s[0], s[1], s[2], s[3]

    def kernel_args(self) -> tuple:
        """The cache arguments every kernel takes, in this order: ``Cache, Lookup, stride_lut_b,
        stride_lut_p, stride_page, stride_kv, stride_row, stride_head, Scales, stride_spage,
        stride_skv, stride_srow, stride_shead``.
        """
        if self.scales is None:
            scales = (self.layer, 0, 0, 0, 0)
        else:
            s = self.scales.stride()
            scales = (self.scales, s[0], s[1], s[2], s[3])
        return (self.layer, self.lookup, *self.lookup_strides, *self.cache_strides, *scales)

    def quant_constexprs(self) -> dict[str, object]:
        """The kernels' quantization constants: ``QUANT`` (0 floating, 1 int8, 2 float8_e4m3fn),
        ``QMAX`` (the storage dtype's largest magnitude), ``QGROUP`` (head-dim elements per scale)
        and ``GROUPS`` (scales per row), with ``GROUPS_PAD`` its power of two."""
        if self.scales is None:
            return {"QUANT": 0, "QMAX": 1.0, "QGROUP": 1, "GROUPS": 1, "GROUPS_PAD": 1}
        groups = self.scales.shape[-1]
        dtype = self.layer.dtype
        return {"QUANT": 1 if dtype == torch.int8 else 2, "QMAX": QMAX[dtype],
                "QGROUP": self.layer.shape[-1] // groups, "GROUPS": groups, "GROUPS_PAD": next_power_of_2(groups)}

    def read_constexprs(self) -> dict[str, object]:
        """What the attention kernels take of :meth:`quant_constexprs`: ``QUANT`` and ``QGROUP``."""
        c = self.quant_constexprs()
        return {"QUANT": c["QUANT"], "QGROUP": c["QGROUP"]}
