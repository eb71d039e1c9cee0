"""Hugging Face architectures, unmodified, generate with kvgraph.LLM exactly like their own ``generate``.

Each is a tiny config with seeded random weights (2 layers, hidden 64, 4 query heads, 2 KV heads
where the architecture has GQA). Three prompts of different lengths run together in one ragged
batch; greedy tokens must equal ``generate``'s for each prompt alone. Architectures whose
attention kvgraph cannot prove are refused with a message naming what it found.
"""

import pytest
import transformers as T

import kvgraph
from kvgraph import LoweringError
from tests.models.tiny_models import COMMON, VOCAB, _build, reference_greedy
from tests.naming import raises_naming

EAGER = "eager"  # architectures without an SDPA implementation in transformers
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=256)
GQA = dict(num_key_value_heads=2)
GPT = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)
PROMPTS = [[5, 9, 17, 33, 2], [7], [100, 3, 3, 8, 64, 1, 2, 90, 11]]
NEW_TOKENS = 12

ARCHITECTURES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, GQA),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, GQA),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(**GQA, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, GQA),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(**GQA, head_dim=16)),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(**GQA, head_dim=16)),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(**GQA, head_dim=16, attn_implementation=EAGER)),
    "phi": (T.PhiConfig, T.PhiForCausalLM, {}),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, GQA),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, GPT),
    "gpt_neo": (T.GPTNeoConfig, T.GPTNeoForCausalLM,
                dict(attention_types=[[["global", "local"], 1]], num_layers=2, window_size=256, attn_implementation=EAGER)),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {}),
    "gptj": (T.GPTJConfig, T.GPTJForCausalLM, dict(**GPT, rotary_dim=8, attn_implementation=EAGER)),
    "gpt_bigcode": (T.GPTBigCodeConfig, T.GPTBigCodeForCausalLM, dict(**GPT, multi_query=True)),
    "opt": (T.OPTConfig, T.OPTForCausalLM, dict(ffn_dim=128, word_embed_proj_dim=64)),
    "falcon": (T.FalconConfig, T.FalconForCausalLM, dict(new_decoder_architecture=True, num_kv_heads=2)),
    "stablelm": (T.StableLmConfig, T.StableLmForCausalLM, GQA),
    "olmo": (T.OlmoConfig, T.OlmoForCausalLM, GQA),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, GQA),
    "starcoder2": (T.Starcoder2Config, T.Starcoder2ForCausalLM, GQA),
    "cohere": (T.CohereConfig, T.CohereForCausalLM, GQA),
    "granite": (T.GraniteConfig, T.GraniteForCausalLM, GQA),
    "smollm3": (T.SmolLM3Config, T.SmolLM3ForCausalLM, GQA),
    "glm": (T.GlmConfig, T.GlmForCausalLM, dict(**GQA, head_dim=16)),
}
REFUSED = {
    "bloom": (T.BloomConfig, T.BloomForCausalLM, dict(n_embed=64, n_layer=2, n_head=4, attn_implementation=EAGER),
              ("softmax", "[..., T, T] scores", "matmul")),  # ALiBi
}


def build(name: str, table: dict):
    config_cls, model_cls, extra = table[name][:3]
    return _build(model_cls, config_cls(**{**COMMON, **SIZES, **extra}), seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_ragged_generation_equals_generate(name):
    model = build(name, ARCHITECTURES)
    refs = [reference_greedy(model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]
    llm = kvgraph.LLM(model, compile="eager", progress=False, max_batch_size=4, max_seq_len=64, page_size=4)
    done = llm.generate(PROMPTS, kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [d.token_ids for d in done] == refs
    assert llm.manager.num_claimed == 0


@pytest.mark.parametrize("name", ["opt", "llama"])
def test_one_sequence_alone_decodes_through_the_one_token_graph(name):
    """Steps of one new token (``T == 1``): OPT's SDPA call then has ``is_causal=False`` and no mask,
    which over one query and one key is causal attention."""
    model = build(name, ARCHITECTURES)
    ref = reference_greedy(model, PROMPTS[0], NEW_TOKENS).tokens[0]
    llm = kvgraph.LLM(model, compile="eager", progress=False, max_batch_size=2, max_seq_len=64, page_size=4)
    (done,) = llm.generate(PROMPTS[:1], kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS))
    assert done.token_ids == ref
    assert llm.manager.num_claimed == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt2", "mixtral"])  # windows, softcap, MHA+bias, MoE
def test_precompiled_graphs_load_and_generate_like_generate(name):
    """Inductor with precompiled graphs (the default): a second engine of the same model loads the
    graph of every step (several tokens, one token) from the first one's file, and both equal ``generate``."""
    prompts = [*PROMPTS, PROMPTS[0]]  # a ragged batch, then one sequence alone (T == 1 decodes)
    refs = [reference_greedy(build(name, ARCHITECTURES), p, NEW_TOKENS).tokens[0] for p in prompts]
    sampling = kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS)
    for _ in range(2):
        llm = kvgraph.LLM(build(name, ARCHITECTURES), progress=False, max_batch_size=4, max_seq_len=64, page_size=4)
        done = llm.generate(PROMPTS, sampling) + llm.generate(prompts[-1:], sampling)
        assert [d.token_ids for d in done] == refs
    assert llm.startup_note() == "1 graph loaded whole from precompiled files, no trace"


@pytest.mark.parametrize("name", list(REFUSED))
def test_attention_that_cannot_be_proven_is_refused_by_node(name):
    model = build(name, REFUSED)
    llm = kvgraph.LLM(model, compile="eager", progress=False, max_batch_size=2, max_seq_len=32)
    with raises_naming(LoweringError, "attention node '", *REFUSED[name][3]):

        llm.generate([[1, 2, 3]], kvgraph.SamplingParams(max_new_tokens=2))
    assert llm.manager.num_claimed == 0
