"""Triton kernel tests run on CUDA with compiled Triton, or else on CPU tensors in Triton's
interpreter, which must be switched on before the kernels are imported (``make test`` sets it).

On CUDA each kernel takes the first config its filter keeps (``KVGRAPH_TRITON_AUTOTUNE=0``) unless
the environment says otherwise: autotuning every test's key (up to 27 compiles and timing runs
each) made the suite take far longer than its checks; ``test_configs.py`` covers the spaces.

The long-context cases allocate up to 2.5 GiB each (plus a clone and the reference's scores), and
each pytest-xdist worker is its own process with its own CUDA cache: fifteen workers on one 80 GB
GPU ran out of memory in 273 tests. Each test on CUDA hands its cached blocks back when it ends;
run these files with ``-n 4`` or fewer on one GPU (about 8 GiB a worker at the peak, estimated).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KVGRAPH_TRITON_AUTOTUNE", "0")


@pytest.fixture(autouse=True)
def _release_cuda_memory():
    """Cached CUDA blocks go back to the driver after each test, for the other workers' processes."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
