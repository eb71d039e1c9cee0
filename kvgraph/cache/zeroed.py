"""Zeroed cache memory that costs nothing until it is written.

``torch.zeros`` of a CPU pool writes every byte before the engine starts: a default llama-56m pool
(8192 pages of 16 tokens, 1 GiB in float32) took 0.3-0.5 s of a 7 s second start, and the whole
pool's resident memory from the first moment. On the CPU the pool is instead an anonymous memory
mapping, which the kernel hands out as zero pages on first touch: the same zeros, paid for page by
page as the cache fills, and never for pages no sequence reaches. Other devices get ``torch.zeros``.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A contiguous ``shape`` tensor of zeros on ``device``; on the CPU backed by an anonymous
    mapping that the tensor keeps alive (``torch.frombuffer`` holds a reference to it)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
