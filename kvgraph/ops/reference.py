"""Pure-PyTorch reference of ``kvgraph::ragged_attention``, and the float64 test golden.

Over a quantized cache the views quantize what they store and dequantize what they load
(:mod:`kvgraph.cache.quant`), so the reference attends over the dequantized cache.

:func:`ragged_attention` is written against the collection views
(:mod:`kvgraph.cache.collection`): it stores the new K/V through ``PagedKVCache.store`` /
``ContinuousBatchingKVCache.store``, loads each sequence's context once, and computes
the attention of all sequences at once (padded to ``max_lengths[0]``) in float32
(float64 for float64 inputs), GQA by grouping query heads, never repeating K/V.

:func:`naive_attention_fp64` is the oracle of the tests: one sequence at a time, in
float64, from explicit K/V histories, sharing no code with the cache views.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgraph.cache.collection import (
    ContinuousBatchingKVCacheCollection,
    PagedKVCacheCollection,
    collection_for,
)
from kvgraph.cache.inputs import RaggedKVCacheInputs
from kvgraph.ops.checks import check_values
from kvgraph.ops.plan import StepPlan, with_op_arguments
from kvgraph.ops.schema import AttentionArgs

Collection = PagedKVCacheCollection | ContinuousBatchingKVCacheCollection

# Largest max-abs error of the reference against the float64 golden on O(1) outputs, per dtype.
GOLDEN_TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 2e-6,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}


def token_positions(
    cache_lengths: torch.Tensor, input_row_offsets: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence and new-token index of every token of a ragged batch.

    Args:
        cache_lengths: integer ``[batch]``.
        input_row_offsets: integer ``[batch + 1]`` prefix sums of new tokens.
        num_tokens: ``T = input_row_offsets[-1]``.

    Returns:
        ``(batch_idx [T], new_idx [T])`` int64: token ``i`` is new token ``new_idx[i]`` of
        sequence ``batch_idx[i]``; its cache position is ``cache_lengths[batch_idx] + new_idx``.
    """
    offs = input_row_offsets.long()
    new_lengths = offs[1:] - offs[:-1]
    batch = new_lengths.shape[0]
    batch_idx = torch.repeat_interleave(
        torch.arange(batch, device=offs.device), new_lengths, output_size=num_tokens
    )
    new_idx = torch.arange(num_tokens, device=offs.device) - offs[batch_idx]
    return batch_idx, new_idx


@dataclass(frozen=True)
class RaggedBatch:
    """Where each token of a ragged batch sits, and the padded ``[batch, max_new, ...]`` layout.

    Attributes:
        batch_idx: int64 ``[T]`` sequence of each token.
        new_idx: int64 ``[T]`` index of each token among its sequence's new tokens.
        cache_lengths: int64 ``[batch]`` tokens cached before this step.
        total_lengths: int64 ``[batch]`` cached + new tokens.
        max_new: padded query length (``max_lengths[0, 0]``).
        max_total: padded context length (``max_lengths[0, 1]``).
    """

    batch_idx: torch.Tensor
    new_idx: torch.Tensor
    cache_lengths: torch.Tensor
    total_lengths: torch.Tensor
    max_new: int
    max_total: int

    @classmethod
    def build(
        cls,
        cache_lengths: torch.Tensor,
        input_row_offsets: torch.Tensor,
        max_lengths: torch.Tensor,
        num_tokens: int,
    ) -> RaggedBatch:
        """From the op's ``cache_lengths [batch]``, ``input_row_offsets [batch + 1]``, ``max_lengths [steps, 2]``."""
        batch_idx, new_idx = token_positions(cache_lengths, input_row_offsets, num_tokens)
        offs = input_row_offsets.long()
        cached = cache_lengths.long()
        return cls(
            batch_idx=batch_idx,
            new_idx=new_idx,
            cache_lengths=cached,
            total_lengths=cached + offs[1:] - offs[:-1],
            max_new=int(max_lengths[0, 0]),
            max_total=int(max_lengths[0, 1]),
        )

    @property
    def batch_size(self) -> int:
        return self.cache_lengths.shape[0]

    @property
    def positions(self) -> torch.Tensor:
        """int64 ``[T]`` cache position of every token."""
        return self.cache_lengths[self.batch_idx] + self.new_idx

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, ...]`` -> ``[batch, max_new, ...]``, zeros where a sequence has fewer new tokens."""
        out = x.new_zeros((self.batch_size, self.max_new, *x.shape[1:]))
        out[self.batch_idx, self.new_idx] = x
        return out

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``x [batch, max_new, ...]`` -> ``[T, ...]``: inverse of :meth:`pad`."""
        return x[self.batch_idx, self.new_idx]

    def mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """bool ``[batch, max_new, max_total]``: new token ``s`` of sequence ``b`` sees position ``j``.

        Causal with the cache as offset: ``j <= cache_lengths[b] + s``, and with a sliding
        window of ``w`` tokens also ``j > cache_lengths[b] + s - w``. Padding rows (``s`` past
        the sequence's new tokens) keep at least their last position, so no row is fully
        masked; they are dropped by :meth:`unpad`.
        """
        device = self.cache_lengths.device
        s = torch.arange(self.max_new, device=device)
        j = torch.arange(self.max_total, device=device)
        # last visible position of each (sequence, new token): [batch, max_new, 1]
        last = (self.cache_lengths[:, None] + s[None, :])[..., None]
        seen = j[None, None, :] <= last
        if sliding_window is not None:
            seen &= j[None, None, :] > last - sliding_window
        return seen


def _collection(
    kv_blocks: torch.Tensor, cache_lengths: torch.Tensor, lookup_table: torch.Tensor, max_lengths: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> Collection:
    return collection_for(RaggedKVCacheInputs(kv_blocks, cache_lengths, lookup_table, max_lengths, kv_scales))


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    cache: Collection | RaggedKVCacheInputs,
    input_row_offsets: torch.Tensor,
    layer_idx: int,
) -> None:
    """Write the new tokens' K and V into layer ``layer_idx`` of the cache, in place.

    Args:
        k, v: ``[T, Hkv, D]`` in the cache dtype.
        cache: a collection view, or the ``RaggedKVCacheInputs`` to view.
        input_row_offsets: integer ``[batch + 1]`` prefix sums of new tokens.
        layer_idx: the layer to write.
    """
    collection = collection_for(cache) if isinstance(cache, RaggedKVCacheInputs) else cache
    cache_lengths = collection.cache_lengths.to(k.device)
    batch_idx, new_idx = token_positions(cache_lengths, input_row_offsets.to(k.device), k.shape[0])
    pos = cache_lengths.long()[batch_idx] + new_idx
    collection.get_key_cache(layer_idx).store(batch_idx, pos, k)
    collection.get_value_cache(layer_idx).store(batch_idx, pos, v)


def ragged_batch(args: AttentionArgs, plan: StepPlan) -> RaggedBatch:
    """The step's :class:`RaggedBatch`, its index values checked (:func:`check_values`) once per step."""
    num_tokens = args.q.shape[0]

    def build() -> RaggedBatch:
        check_values(args.kv_blocks, args.cache_lengths, args.lookup_table, args.input_row_offsets,
                     args.max_lengths, num_tokens)
        return RaggedBatch.build(args.cache_lengths, args.input_row_offsets, args.max_lengths, num_tokens)

    return plan.derived((RaggedBatch, num_tokens), build)


def store_and_load_context(args: AttentionArgs, plan: StepPlan) -> tuple[RaggedBatch, torch.Tensor, torch.Tensor]:
    """The op's first half on arguments checked against ``plan``: check the index values (once per
    step), store the new K/V, load every sequence's whole context.

    Returns ``(batch, k_ctx, v_ctx)`` with ``k_ctx, v_ctx`` ``[batch, max_total, Hkv, D]`` in the
    cache dtype (float32 dequantized from a quantized cache), zero past each sequence's length.
    """
    batch = ragged_batch(args, plan)
    collection = plan.derived(
        Collection,
        lambda: _collection(args.kv_blocks, args.cache_lengths, args.lookup_table, args.max_lengths, args.kv_scales),
    )
    keys, values = collection.get_key_cache(args.layer_idx), collection.get_value_cache(args.layer_idx)
    positions = batch.positions
    keys.store(batch.batch_idx, positions, args.k)
    values.store(batch.batch_idx, positions, args.v)
    return batch, keys.load_padded(batch.total_lengths, batch.max_total), values.load_padded(
        batch.total_lengths, batch.max_total
    )


def run(args: AttentionArgs, plan: StepPlan) -> torch.Tensor:
    """Reference of ``torch.ops.kvgraph.ragged_attention`` on arguments checked against ``plan``.

    Arguments and shapes are :class:`~kvgraph.ops.schema.AttentionArgs`'; the cache writes are the op's.

    Returns:
        ``[T, Hq, D]`` in q's dtype, computed in float32 (float64 for float64 inputs).
    """
    batch, k_ctx, v_ctx = store_and_load_context(args, plan)
    q = args.q
    T, Hq, D = q.shape
    Hkv = args.k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(D) if args.scale is None else args.scale
    B, S = batch.batch_size, batch.max_new
    # qg: [B, S, Hkv, G, D]: the G query heads of one kv head side by side
    qg = batch.pad(q).to(acc).view(B, S, Hkv, Hq // Hkv, D)
    scores = torch.einsum("bshgd,blhd->bhgsl", qg, k_ctx.to(acc)) * scale  # [B, Hkv, G, S, L]
    if args.softcap is not None:
        scores = args.softcap * torch.tanh(scores / args.softcap)
    scores = scores.masked_fill(~batch.mask(args.sliding_window)[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgsl,blhd->bshgd", probs, v_ctx.to(acc))  # [B, S, Hkv, G, D]
    return batch.unpad(out.reshape(B, S, Hq, D)).to(q.dtype)


ragged_attention = with_op_arguments(run)


def naive_attention_fp64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cached: Sequence[torch.Tensor],
    v_cached: Sequence[torch.Tensor],
    input_row_offsets: torch.Tensor | Sequence[int],
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Float64 golden: causal attention of each sequence's new tokens over its history, one sequence at a time.

    Args:
        q: ``[T, Hq, D]`` new tokens of all sequences.
        k, v: ``[T, Hkv, D]`` their keys and values.
        k_cached, v_cached: per sequence ``[cache_len_b, Hkv, D]``: what the cache held before the step.
        input_row_offsets: ``[batch + 1]`` prefix sums of new tokens.
        scale: softmax scale; ``None`` means ``1 / sqrt(D)``.
        sliding_window: keys each token sees, itself included (``None``: every earlier one).
        softcap: scores ``s`` become ``softcap * tanh(s / softcap)`` (``None``: unchanged).

    Returns:
        ``[T, Hq, D]`` float64.
    """
    offs = [int(x) for x in input_row_offsets]
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(T, Hq, D, dtype=torch.float64, device=q.device)
    for b in range(len(offs) - 1):
        lo, hi = offs[b], offs[b + 1]
        cached = k_cached[b].shape[0]
        keys = torch.cat([k_cached[b], k[lo:hi]]).double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = torch.cat([v_cached[b], v[lo:hi]]).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("shd,lhd->hsl", q[lo:hi].double(), keys) * scale  # [Hq, S, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        s = torch.arange(hi - lo, device=q.device)[:, None]
        j = torch.arange(keys.shape[0], device=q.device)[None, :]
        hidden = j > cached + s
        if sliding_window is not None:
            hidden |= j <= cached + s - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[lo:hi] = torch.einsum("hsl,lhd->shd", torch.softmax(scores, dim=-1), values)
    return out
