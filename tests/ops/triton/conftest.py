"""Triton kernel tests run on CUDA with compiled Triton, or else on CPU tensors in Triton's
interpreter, which must be switched on before the kernels are imported (``make test`` sets it).

On CUDA each kernel takes the first config its filter keeps (``KVGRAPH_TRITON_AUTOTUNE=0``) unless
the environment says otherwise: autotuning every test's key (up to 27 compiles and timing runs
each) made the suite take far longer than its checks; ``test_configs.py`` covers the spaces.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KVGRAPH_TRITON_AUTOTUNE", "0")
