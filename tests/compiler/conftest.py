"""Fixtures of the backend's tests: a fresh Dynamo for each test, and the toy decoder."""

import pytest
import torch
from torch._dynamo.utils import counters

from tests.compiler.toy import ToyDecoder


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ToyDecoder().eval()
