"""Shared fixtures of the kernel tests: random ragged batches over a random cache, and the golden.

``make_kv_case(lengths, ...)`` builds a cache whose sequences hold random K/V histories
in randomly permuted pages (paged) or slots (continuous), plus the new tokens' q/k/v and
the op's index tensors. Cache placement is computed here with plain Python ints, sharing
no code with ``kvgraph.cache.collection``, so the tests check the views too.
``check_against_golden`` asserts an output's error against the float64 golden is within a
small multiple of the reference's own error at that dtype.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

import kvgraph.ops  # noqa: F401  (registers torch.ops.kvgraph.ragged_attention)
from kvgraph.cache.inputs import RaggedKVCacheInputs
from kvgraph.ops.reference import GOLDEN_TOLERANCE, naive_attention_fp64
from kvgraph.ops.schema import AttentionArgs


@dataclass
class KVCase:
    """One step of a ragged batch over a filled cache: the op's arguments and the history they hold.

    The op's arguments (``q``, ``k``, ``v``, ``kv_blocks``, ``cache_lengths``, ``lookup_table``,
    ``input_row_offsets``, ``max_lengths``, ``layer_idx``; see :class:`AttentionArgs`) read and
    write as attributes of the case; ``kv_blocks`` holds every sequence's history.

    Attributes:
        call: the op's arguments (``scale`` and the later ones at their defaults).
        k_cached, v_cached: per sequence ``[cache_len_b, Hkv, D]``: the history in the cache.
        page_size: rows per page (paged) or None (continuous).
    """

    call: AttentionArgs
    k_cached: list[torch.Tensor]
    v_cached: list[torch.Tensor]
    page_size: int | None

    def __getattr__(self, name: str):
        if name in AttentionArgs._fields:
            return getattr(self.__dict__.get("call"), name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value) -> None:
        if name in AttentionArgs._fields:
            self.call = self.call._replace(**{name: value})
        else:
            super().__setattr__(name, value)

    def args(self) -> tuple:
        """The op's positional arguments (without ``scale``)."""
        return tuple(self.call)[: AttentionArgs._fields.index("scale")]

    def clone(self) -> KVCase:
        """A copy with its own ``kv_blocks``, so that each implementation writes a fresh cache."""
        other = copy.copy(self)
        other.kv_blocks = self.kv_blocks.clone()
        return other

    @property
    def inputs(self) -> RaggedKVCacheInputs:
        return RaggedKVCacheInputs(self.kv_blocks, self.cache_lengths, self.lookup_table, self.max_lengths)

    def location(self, b: int, pos: int) -> tuple[int, int]:
        """(block, row) of position ``pos`` of sequence ``b``."""
        if self.page_size is None:
            return int(self.lookup_table[b]), pos
        return int(self.lookup_table[b, pos // self.page_size]), pos % self.page_size

    def golden(
        self, scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None
    ) -> torch.Tensor:
        """float64 ``[T, Hq, D]`` expected output."""
        return naive_attention_fp64(
            self.q, self.k, self.v, self.k_cached, self.v_cached, self.input_row_offsets, scale, sliding_window,
            softcap,
        )

    def expected_blocks(self, before: torch.Tensor) -> torch.Tensor:
        """``before`` with exactly the new tokens' K/V written at their positions of ``layer_idx``."""
        out = before.clone()
        offs = self.input_row_offsets.tolist()
        for b in range(len(offs) - 1):
            cached = int(self.cache_lengths[b])
            for i in range(offs[b], offs[b + 1]):
                block, row = self.location(b, cached + i - offs[b])
                out[block, 0, self.layer_idx, row] = self.k[i]
                out[block, 1, self.layer_idx, row] = self.v[i]
        return out


def make_case(
    lengths: Sequence[tuple[int, int]],
    *,
    page_size: int | None = 16,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 2,
    layer_idx: int = 1,
    device: str | torch.device = "cpu",
    seed: int = 0,
    fill: float | None = None,
) -> KVCase:
    """A random ragged step: ``lengths[b] = (cached, new)`` tokens of sequence ``b``.

    ``page_size=None`` builds a continuous cache (one slot per sequence plus a spare slot);
    otherwise pages are shuffled across the pool, two pages stay free, and the lookup table
    has one more column than any sequence needs (unused entries = ``total_num_pages``).
    Cache rows outside the histories hold random values, or ``fill`` (e.g. NaN) if given.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    batch = len(lengths)
    totals = [c + n for c, n in lengths]
    if page_size is None:
        slots = batch + 1
        blocks_shape = (slots, 2, num_layers, max(totals, default=0) + 3, n_kv_heads, head_dim)
        lookup = torch.randperm(slots, generator=gen)[:batch].to(torch.int32)
    else:
        pages_per_seq = [-(-t // page_size) for t in totals]
        num_pages = sum(pages_per_seq) + 2
        blocks_shape = (num_pages, 2, num_layers, page_size, n_kv_heads, head_dim)
        perm = torch.randperm(num_pages, generator=gen).tolist()
        lookup = torch.full((batch, max(pages_per_seq, default=0) + 1), num_pages, dtype=torch.int32)
        for b, n in enumerate(pages_per_seq):
            lookup[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
    blocks = randn(*blocks_shape) if fill is None else torch.full(blocks_shape, fill, dtype=dtype)
    T = sum(n for _, n in lengths)
    call = AttentionArgs(
        q=randn(T, n_heads, head_dim),
        k=randn(T, n_kv_heads, head_dim),
        v=randn(T, n_kv_heads, head_dim),
        kv_blocks=blocks,
        cache_lengths=torch.tensor([c for c, _ in lengths], dtype=torch.int32),
        lookup_table=lookup,
        input_row_offsets=torch.tensor([0] + list(torch.tensor([n for _, n in lengths]).cumsum(0).tolist()),
                                       dtype=torch.int32),
        max_lengths=torch.tensor([[max((n for _, n in lengths), default=0), max(totals, default=0)]],
                                 dtype=torch.int32),
        layer_idx=layer_idx,
    )
    case = KVCase(
        call=call,
        k_cached=[randn(c, n_kv_heads, head_dim) for c, _ in lengths],
        v_cached=[randn(c, n_kv_heads, head_dim) for c, _ in lengths],
        page_size=page_size,
    )
    for b, (cached, _) in enumerate(lengths):
        for pos in range(cached):
            block, row = case.location(b, pos)
            blocks[block, 0, layer_idx, row] = case.k_cached[b][pos]
            blocks[block, 1, layer_idx, row] = case.v_cached[b][pos]
    return _to_device(case, torch.device(device))


def _to_device(case: KVCase, device: torch.device) -> KVCase:
    if device.type == "cpu":
        return case
    moved = copy.copy(case)
    moved.call = AttentionArgs(*(
        a.to(device) if isinstance(a, torch.Tensor) and name != "max_lengths" else a  # max_lengths stays on the CPU
        for name, a in zip(AttentionArgs._fields, case.call, strict=True)
    ))
    moved.k_cached = [t.to(device) for t in case.k_cached]
    moved.v_cached = [t.to(device) for t in case.v_cached]
    return moved


def assert_close_to_golden(
    out: torch.Tensor, golden: torch.Tensor, reference_out: torch.Tensor, factor: float = 4.0
) -> None:
    """``out``'s max error vs the float64 ``golden`` is within ``factor`` x the reference's own error.

    The reference's error is floored at one ulp of the output's magnitude, so an exact
    reference does not demand an exact kernel.
    """
    assert out.shape == golden.shape, (out.shape, golden.shape)
    assert not out.isnan().any(), "output has NaNs"
    golden = golden.to(out.device)
    err = (out.double() - golden).abs().max().item() if out.numel() else 0.0
    ref_err = (reference_out.double().to(out.device) - golden).abs().max().item() if out.numel() else 0.0
    ulp = torch.finfo(out.dtype).eps * max(golden.abs().max().item() if out.numel() else 0.0, 1.0)
    assert err <= factor * max(ref_err, ulp), (
        f"max error {err:.3g} exceeds {factor} x reference error {ref_err:.3g} (ulp {ulp:.3g}) at {out.dtype}"
    )


@pytest.fixture
def make_kv_case():
    """Factory fixture: ``make_kv_case(lengths, page_size=16, n_heads=4, n_kv_heads=2, head_dim=16,
    dtype=torch.float32, num_layers=2, layer_idx=1, device="cpu", seed=0, fill=None) -> KVCase``."""
    return make_case


@pytest.fixture
def check_against_golden():
    """``check_against_golden(out, golden, reference_out, factor=4.0)``: see :func:`assert_close_to_golden`."""
    return assert_close_to_golden


# (cached, new) tokens per sequence: the batch shapes every kernel is checked on.
RAGGED_LENGTHS = {
    "decode": [(5, 1), (16, 1), (0, 1), (33, 1)],
    "prefill_odd": [(0, 17), (0, 97)],
    "mixed": [(20, 1), (0, 17), (7, 9), (40, 1)],
    "page_exactly_full": [(15, 1), (112, 16), (0, 128)],
    "one_token": [(0, 1)],
    "sequence_without_new_tokens": [(9, 0), (3, 2)],
}


@pytest.fixture(params=list(RAGGED_LENGTHS.values()), ids=list(RAGGED_LENGTHS))
def ragged_lengths(request) -> list[tuple[int, int]]:
    """Each batch shape of ``RAGGED_LENGTHS`` in turn."""
    return request.param


@pytest.fixture(params=[1, 16, 128, None], ids=["page1", "page16", "page128", "continuous"])
def cache_page_size(request) -> int | None:
    """Page sizes 1, 16, 128, and None for the continuous strategy."""
    return request.param


@pytest.fixture
def reference_tol() -> dict[torch.dtype, float]:
    """Largest allowed max-abs error of the reference against the golden, per dtype."""
    return GOLDEN_TOLERANCE
