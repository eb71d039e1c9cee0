"""``LLM(kv_cache_dtype=...)``: the engine over a quantized KV cache, refused before any compile
where no kernel reads one, and otherwise close to the float32 cache.

The figures beside the bounds were measured on llama-tiny (random weights: near-tied logits, so
greedy generations part early even under small errors; bfloat16 weights alone move its logits by
0.048, see test_quantization.py).
"""

import pytest
import torch
from torch._dynamo.utils import counters

import kvgraph
from kvgraph.engine.config import EngineConfig
from kvgraph.entrypoints.cli.kv_quality import kv_cache_quality
from kvgraph.entrypoints.cli.quality import agreement
from kvgraph.errors import ConfigError, InvalidParamsError
from kvgraph.presets import load_preset
from tests.naming import raises_naming

NEW_TOKENS = 32


def token_stream(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- refused before anything is compiled --
@pytest.mark.parametrize(("value", "fragments"), [
    ("int4", ("kv_cache_dtype 'int4'", "auto, int8, fp8_e4m3")),
    (torch.float16, ("kv_cache_dtype", "torch.float16", "torch.int8", "torch.float8_e4m3fn")),
])
def test_an_unknown_kv_cache_dtype_is_refused_by_the_config(value, fragments):
    with raises_naming(ConfigError, *fragments):
        EngineConfig(kv_cache_dtype=value)


def test_names_and_dtypes_are_the_same_config():
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype is torch.int8
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype is torch.float8_e4m3fn
    assert EngineConfig(kv_cache_dtype="auto").kv_cache_dtype is None


def test_a_device_without_a_quantized_kernel_is_refused_by_the_config(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig(kv_cache_dtype=torch.int8, device="cuda").kv_cache_dtype is torch.int8  # Triton reads it
    with raises_naming(ConfigError, "kv_cache_dtype=torch.int8", "cpu or cuda", "device meta"):
        EngineConfig(kv_cache_dtype=torch.int8, device="meta")


def test_a_granularity_that_does_not_divide_the_head_size_is_refused_before_any_compile():
    """MAX's default granularity 128, clamped to a head size of 192, does not divide it."""
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=384, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    graphs = counters["kvgraph"]["graphs"]
    with raises_naming(InvalidParamsError, "quantization_granularity=128", "head_dim=192"):
        kvgraph.LLM(model, kv_cache_dtype="int8", compile="eager", progress=False)
    assert counters["kvgraph"]["graphs"] == graphs


# -- the engine over the quantized cache --
@pytest.fixture(scope="module")
def llms():
    made = {dtype: kvgraph.LLM("llama-tiny", compile="eager", kv_cache_dtype=dtype, max_batch_size=8,
                               max_seq_len=64, progress=False) for dtype in (None, "int8", "fp8_e4m3")}
    yield made
    for llm in made.values():
        llm.close()


def test_the_engine_holds_its_cache_quantized(llms):
    manager = llms["int8"].manager
    assert manager.blocks.dtype == torch.int8 and manager.kv_scales.dtype == torch.float32
    assert manager.params.scale_group == 16  # llama-tiny's head size: 128 clamped to 16
    assert manager.params.page_bytes * 4 < llms[None].manager.params.page_bytes * 2


def generate(llm, prompts):
    done = llm.generate(prompts, kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    return [d.token_ids for d in done]


@pytest.mark.parametrize(("dtype", "min_mean"), [
    ("int8", 16),     # mean leading tokens equal to the float32 cache's over 8 prompts: 21.6 of 32
    ("fp8_e4m3", 3),  # 3 mantissa bits: 5.75
])
def test_greedy_generation_agrees_with_the_float32_cache_for_a_while(llms, dtype, min_mean):
    prompts = [token_stream(8, seed) for seed in range(8)]
    exact = generate(llms[None], prompts)
    quantized = generate(llms[dtype], prompts)
    mean = sum(agreement(q, e) for q, e in zip(quantized, exact, strict=True)) / len(prompts)
    assert mean >= min_mean


@pytest.mark.parametrize(("dtype", "max_error"), [
    (torch.int8, 0.015),          # max |logit error| over 64 teacher-forced positions: 0.023 = 0.72% of the
    (torch.float8_e4m3fn, 0.08),  # largest logit (3.18); fp8 0.122 = 3.9%. Same next token at 95% / 91%
])
def test_logit_error_of_the_quantized_cache_is_bounded(dtype, max_error):
    model, _ = load_preset("llama-tiny")
    q = kv_cache_quality(model.eval(), token_stream(8), 64, dtype)
    assert 0 < q["max_abs_logit_error"] <= max_error * q["reference_max_abs_logit"]
    assert q["argmax_agreement"] >= 0.85
