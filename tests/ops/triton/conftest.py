"""Triton kernel tests run on CUDA with compiled Triton, or else on CPU tensors in Triton's
interpreter, which must be switched on before the kernels are imported (``make test`` sets it).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
