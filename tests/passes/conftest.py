"""Session fixtures of the pass tests: one capture per tiny model (see ``lowering_helpers``)."""

from __future__ import annotations

import pytest

from tests.nanogpt_model import NanoGPT
from tests.passes.lowering_helpers import (
    VOCAB,
    Captured,
    capture,
    hf_kwargs,
    model_kwargs,
    tiny_gpt2,
    tiny_llama,
    tiny_qwen2,
)


# -- session fixtures: one capture per model --
@pytest.fixture(scope="session")
def llama_sdpa() -> Captured:
    return capture(tiny_llama("sdpa"), **hf_kwargs())


@pytest.fixture(scope="session")
def llama_eager() -> Captured:
    return capture(tiny_llama("eager"), **hf_kwargs())


@pytest.fixture(scope="session")
def gpt2_sdpa() -> Captured:
    return capture(tiny_gpt2("sdpa"), **hf_kwargs())


@pytest.fixture(scope="session")
def qwen2_sdpa() -> Captured:
    return capture(tiny_qwen2("sdpa"), **hf_kwargs())


@pytest.fixture(scope="session")
def nanogpt() -> Captured:
    return capture(NanoGPT(VOCAB), **model_kwargs())
