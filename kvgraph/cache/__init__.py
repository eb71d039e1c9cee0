"""The KV cache, MAX's design in PyTorch (layer 1): params, the graph-input schema (symbols), the
inputs a manager hands a graph, views over them (collections), requests, and the managers.

Depends only on ``kvgraph.errors``; everything above (ops, passes, compiler, engine) builds on it.
"""
