"""The operators of kvgraph: ``kvgraph::ragged_attention`` (its schema, per-step plan, dispatch,
reference, CPU path, C++ and Triton kernels) and ``kvgraph::linear``.

Importing this package registers ``torch.ops.kvgraph.ragged_attention``.
"""

from kvgraph.ops import attention
from kvgraph.ops.attention import ragged_attention
from kvgraph.ops.checks import check_inputs, check_values
from kvgraph.ops.plan import StepPlan, bound_step
from kvgraph.ops.schema import SCHEMA, AttentionArgs

__all__ = ["SCHEMA", "AttentionArgs", "StepPlan", "attention", "bound_step", "check_inputs", "check_values",
           "ragged_attention"]
