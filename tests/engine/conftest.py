"""Shared pieces of the engine tests: the tiny Llama preset and its own eager greedy decoding."""

import pytest
import torch

from kvgraph.presets import load_preset


@pytest.fixture(scope="session")
def llama():
    """The ``llama-tiny`` preset (model, byte tokenizer)."""
    return load_preset("llama-tiny")


def _hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The model's own eager greedy continuation (Hugging Face ``generate``), EOS ignored."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True,
        )
    return out[0, len(prompt):].tolist()


def _eager_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding of any ``input_ids, position_ids -> logits`` module by recomputing the
    whole sequence each step (no cache): the oracle for modules without ``generate``."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            x = torch.tensor([ids])
            out = model(input_ids=x, position_ids=torch.arange(len(ids))[None])
            logits = out if isinstance(out, torch.Tensor) else out.logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def _prompts_with_shared_prefix(prefix_len: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 259, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 259, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


@pytest.fixture(scope="session")
def eager_greedy():
    return _eager_greedy


@pytest.fixture(scope="session")
def shared_prefix_prompts():
    return _prompts_with_shared_prefix


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo_per_module():
    """Each module starts from an empty Dynamo cache, so its recompile counts are its own."""
    torch._dynamo.reset()
    yield
