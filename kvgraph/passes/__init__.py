"""FX graph passes that lower a captured decoder onto the paged KV cache.

``lower(gm, ...)`` runs the whole pipeline (see :mod:`kvgraph.passes.pipeline`); the passes
live one per module: ``find_attention``, ``add_kv_inputs``, ``lower_attention``,
``prune_logits``, ``packed_linears`` and ``verify`` (dce + verification), over the networkx view of
:mod:`kvgraph.passes.graph_view`.
"""

from kvgraph.passes.pipeline import LoweringPipeline, LoweringResult, lower

__all__ = ["LoweringPipeline", "LoweringResult", "lower"]
