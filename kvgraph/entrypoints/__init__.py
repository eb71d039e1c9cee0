"""What users call (layer 7): ``kvgraph.LLM``, the ``kvgraph`` command line and the HTTP server.

Builds on every layer below: the engine, and tensor parallelism when asked for.
"""
