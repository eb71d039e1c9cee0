"""Compiling a model onto the cache (layer 4): the ``torch.compile`` backend, the runtime binding
of a step's cache inputs, one ragged step, and the Hugging Face specifics of capture.

Builds on the cache, the ops and the passes; the engine builds on it.
"""
