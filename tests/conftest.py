"""Suite-wide set-up: without CUDA, Triton kernels run in Triton's interpreter on CPU tensors.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel module is imported, so it is set here,
before any test module can import one.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
