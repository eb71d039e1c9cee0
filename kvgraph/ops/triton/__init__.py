"""Triton kernels of ``kvgraph::ragged_attention``: fused KV store, ragged paged flash attention
(prefill / mixed batches) and flash-decoding, for the paged and continuous cache strategies.

They run on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
set before Triton is first imported).
"""

from kvgraph.ops.triton.api import ragged_attention
from kvgraph.ops.triton.decode import choose_num_splits, decode_attention
from kvgraph.ops.triton.prefill import prefill_attention
from kvgraph.ops.triton.store import store_kv

__all__ = ["choose_num_splits", "decode_attention", "prefill_attention", "ragged_attention", "store_kv"]
