"""The Hugging Face baselines decode exactly as kvgraph's ``ignore_eos`` runs do."""

import pytest
import torch

from kvgraph.cache.params import KVCacheParams
from kvgraph.entrypoints.cli.baselines import hf_generate, hf_generate_batch
from kvgraph.presets import load_preset

NEW = 6
PROMPTS = [[5, 17, 99, 42, 7, 64, 3], [11, 12, 13]]


@pytest.fixture(scope="module")
def model_with_eos_midway():
    """llama-tiny whose EOS is the token greedy decoding of PROMPTS[0] emits at its third step."""
    model, _ = load_preset("llama-tiny")
    ids = list(PROMPTS[0])
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    model.config.eos_token_id = model.generation_config.eos_token_id = ids[-1]
    return model



def eager_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def kv_params(model):
    c = model.config
    return KVCacheParams(torch.float32, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                         c.num_hidden_layers)


def test_hf_generate_emits_eos_and_goes_on(model_with_eos_midway):
    model = model_with_eos_midway
    want = [eager_greedy(model, p, NEW) for p in PROMPTS]
    assert want[0][2] == model.generation_config.eos_token_id
    got = hf_generate(model, PROMPTS, NEW, batch_size=2, params=kv_params(model))
    assert got.outputs == want


def test_hf_generate_batch_emits_eos_and_goes_on(model_with_eos_midway):
    model = model_with_eos_midway
    want = [eager_greedy(model, p, NEW) for p in PROMPTS]
    got = hf_generate_batch(model, PROMPTS, NEW, num_pages=16, page_size=16, max_batch_size=2,
                            max_batch_tokens=64, params=kv_params(model))
    assert got.outputs == want
