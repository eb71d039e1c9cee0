"""Triton kernels of ``kvgraph::ragged_attention``: fused KV store, ragged paged flash attention
(prefill / mixed batches) and flash-decoding, for the paged and continuous cache strategies.

They run on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
set before Triton is first imported).
"""

from kvgraph.kernels.triton.api import ragged_attention
from kvgraph.kernels.triton.decode import choose_num_splits, decode_attention
from kvgraph.kernels.triton.prefill import prefill_attention
from kvgraph.kernels.triton.store import store_kv

__all__ = ["choose_num_splits", "decode_attention", "prefill_attention", "ragged_attention", "store_kv"]
