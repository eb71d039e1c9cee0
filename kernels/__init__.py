"""Kernels of kvgraph: the ``kvgraph::ragged_attention`` custom op, its reference and CPU path.

Importing this package registers ``torch.ops.kvgraph.ragged_attention``.
"""

from kvgraph.kernels import ops
from kvgraph.kernels.ops import check_inputs, check_values, ragged_attention

__all__ = ["ops", "check_inputs", "check_values", "ragged_attention"]
