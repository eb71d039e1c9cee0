"""Fixtures of the model tests: the tiny Hugging Face factories of ``tiny_models`` and a fresh Dynamo."""

import pytest
import torch

from tests.models.tiny_models import tiny_gpt2, tiny_llama, tiny_qwen2


@pytest.fixture(name="tiny_llama")
def tiny_llama_factory():
    return tiny_llama


@pytest.fixture(name="tiny_gpt2")
def tiny_gpt2_factory():
    return tiny_gpt2


@pytest.fixture(name="tiny_qwen2")
def tiny_qwen2_factory():
    return tiny_qwen2


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles afresh, so its compile and recompile counts are its own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
