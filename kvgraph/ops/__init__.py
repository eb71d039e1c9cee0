"""The operators of kvgraph: ``kvgraph::ragged_attention`` (its contract, reference, CPU path, C++ and
Triton kernels) and ``kvgraph::linear``.

Importing this package registers ``torch.ops.kvgraph.ragged_attention``.
"""

from kvgraph.ops import attention
from kvgraph.ops.attention import ragged_attention
from kvgraph.ops.checks import check_inputs, check_values

__all__ = ["attention", "check_inputs", "check_values", "ragged_attention"]
