"""Weight-only int8 quantization: refused before any compile where it cannot run, and otherwise the
same lowering with quantized linear layers, close to the float32 model.

Quality is measured against float32 with bfloat16's own error as the yardstick (a quantized model
runs in bfloat16): the measured figures are in the comments beside each bound.
"""

import copy
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import kvgraph
from kvgraph.engine.config import EngineConfig
from kvgraph.engine.quantization import (
    QUANTIZATION_SCHEMES,
    Int8WeightOnlyLinear,
    dequantized,
    output_projection,
    quantize,
    weight_bytes,
)
from kvgraph.entrypoints.cli.quality import agreement, quality
from kvgraph.errors import ConfigError, MissingExtraError
from kvgraph.ops import attention
from kvgraph.presets import load_preset

SCHEME = "int8-weight-only"
NEW_TOKENS = 32


def bf16(preset: str, scheme: str | None = None, lm_head: bool = False) -> torch.nn.Module:
    """The preset in bfloat16, quantized with ``scheme`` when given."""
    model, _ = load_preset(preset)
    model = model.to(torch.bfloat16)
    return quantize(model, scheme, lm_head=lm_head) if scheme else model


def token_stream(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- refused before anything is loaded or compiled --
@pytest.mark.parametrize(("fields", "message"), [
    ({"quantization": "int4-weight-only"}, r"quantization must be None or one of 'int8-weight-only', got 'int4-weight-only'"),
    ({"quantization": SCHEME, "dtype": torch.float32}, r"runs with dtype torch\.bfloat16 only.*got torch\.float32"),
    ({"quantization": SCHEME, "dtype": torch.float16}, r"runs with dtype torch\.bfloat16 only.*got torch\.float16"),
    ({"quantization": SCHEME, "dtype": torch.bfloat16, "tensor_parallel_size": 2},
     r"tensor_parallel_size=2.*quantization runs on 1 rank only"),
    ({"quantize_lm_head": True}, r"quantize_lm_head=True needs a quantization scheme"),
    ({"quantization": SCHEME, "quantize_lm_head": 1}, r"quantize_lm_head must be a bool, got 1"),
])
def test_a_quantization_it_cannot_run_is_refused_by_the_config(fields, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**fields)


def test_a_float32_model_is_refused_before_any_compile():
    graphs = counters["kvgraph"]["graphs"]
    with pytest.raises(ConfigError, match=r"runs with dtype torch\.bfloat16 only.*got torch\.float32.*--dtype bfloat16"):
        kvgraph.LLM("llama-tiny", quantization=SCHEME, compile="eager", progress=False)
    assert counters["kvgraph"]["graphs"] == graphs


def test_without_torchao_the_quant_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(MissingExtraError, match=r"needs the 'quant' extra: pip install 'kvgraph\[quant\]'"):
        bf16("llama-tiny", SCHEME)


def test_a_model_without_linear_layers_is_refused():
    with pytest.raises(ConfigError, match=r"found no nn\.Linear layer to quantize in GPT2LMHeadModel"):
        bf16("gpt2-tiny", SCHEME)  # GPT-2's projections are Conv1D


def test_a_tied_vocabulary_projection_is_not_quantized_twice():
    with pytest.raises(ConfigError, match=r"shares its weight with the input embedding"):
        bf16("gpt2-tiny", SCHEME, lm_head=True)


def test_only_int8_weight_only_is_offered():
    # int4 is left out: torchao 0.18's int4 weight-only formats need CUDA (mslk, tinygemm), and its
    # CPU int4 (IntxWeightOnlyConfig) stores one int4 per byte and dequantizes at every call.
    assert QUANTIZATION_SCHEMES == (SCHEME,)


# -- what is quantized --
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny"])
def test_linear_weights_become_int8_and_the_lm_head_only_on_request(preset):
    plain, body, full = bf16(preset), bf16(preset, SCHEME), bf16(preset, SCHEME, lm_head=True)
    head = output_projection(body).weight
    assert type(head) is torch.nn.Parameter and head.dtype == torch.bfloat16
    assert isinstance(output_projection(full), Int8WeightOnlyLinear)
    up = body.model.layers[0].mlp.up_proj
    assert isinstance(up, Int8WeightOnlyLinear) and up.weight_int8.dtype == torch.int8
    assert up.weight_scale.shape == (up.out_features,) and up.weight.dtype == torch.bfloat16
    assert body.model.embed_tokens.weight.dtype == torch.bfloat16
    # llama-tiny: 214432 bytes in bfloat16, 145824 int8, 130543 with the lm_head too
    assert weight_bytes(full) < weight_bytes(body) < 0.7 * weight_bytes(plain)


def test_a_weight_torchao_did_not_quantize_per_row_is_refused():
    with pytest.raises(ConfigError, match=r"torchao quantized Linear's weight as Parameter, not as int8 data"):
        Int8WeightOnlyLinear.from_quantized(torch.nn.Linear(4, 3))


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny"])  # qwen2: q, k and v have a bias
@pytest.mark.parametrize("tokens", [4, 16, 100])  # ATen's int8 kernel, the fused one, dequantize + GEMM
def test_a_dequantized_copy_computes_what_the_quantized_model_does(preset, tokens):
    model = bf16(preset, SCHEME, lm_head=True)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Int8WeightOnlyLinear) and (q_proj.bias is not None) == (preset == "qwen2-tiny")
    plain = dequantized(copy.deepcopy(model))
    assert all(type(p) is torch.nn.Parameter for p in plain.parameters())
    ids = token_stream(tokens)
    with torch.no_grad():
        a, b = model(torch.tensor([ids])).logits, plain(torch.tensor([ids])).logits
    torch.testing.assert_close(a, b, atol=0.05, rtol=0)  # the same product, rounded apart in bf16
    assert plain.to(torch.float64)(torch.tensor([ids])).logits.dtype == torch.float64


# -- quality against float32 --
@pytest.mark.parametrize(("preset", "max_error_ratio"), [
    ("llama-tiny", 2.5),   # max |logit error|: bf16 0.048, int8 0.099, int8 with lm_head 0.101
    ("llama-small", 2.5),  # bf16 0.346, int8 0.737, int8 with lm_head 0.706 (logits up to 6.9)
])
@pytest.mark.parametrize("lm_head", [False, True])
def test_logit_error_is_bounded_by_bfloat16s_own(preset, max_error_ratio, lm_head):
    reference, _ = load_preset(preset)
    ids = token_stream(128)
    own = quality(bf16(preset), reference, ids)
    int8 = quality(bf16(preset, SCHEME, lm_head), reference, ids)
    assert int8["max_abs_logit_error"] <= max_error_ratio * own["max_abs_logit_error"]
    assert int8["max_abs_logit_error"] <= 0.12 * int8["reference_max_abs_logit"]
    # the same next token at 98% (llama-tiny) and 86% (llama-small) of the positions, bf16 97% and 95%
    assert int8["argmax_agreement"] >= 0.8


@pytest.mark.parametrize("preset", ["llama-tiny", "llama-small"])
def test_log_likelihood_of_a_token_stream_stays_close(preset):
    # mean log-likelihood over 127 tokens (about -6: random weights): bf16 within 0.001 of float32,
    # int8 within 0.006 (llama-tiny +0.0024, llama-small -0.0052)
    reference, _ = load_preset(preset)
    assert abs(quality(bf16(preset, SCHEME), reference, token_stream(128))["log_likelihood_diff"]) < 0.02


@pytest.fixture(scope="module")
def int8_llm():
    llm = kvgraph.LLM(bf16("llama-tiny", SCHEME), compile="eager", max_batch_size=8, max_seq_len=64, progress=False)
    yield llm
    llm.close()


def test_greedy_generation_agrees_with_float32_about_as_long_as_bfloat16(int8_llm, eager_greedy):
    # mean leading tokens equal to float32's over 8 prompts of 32 tokens: bf16 27.6, int8 24.0
    reference, _ = load_preset("llama-tiny")
    plain = bf16("llama-tiny")
    prompts = [token_stream(8, seed) for seed in range(8)]
    exact = [eager_greedy(reference, p, NEW_TOKENS) for p in prompts]
    done = int8_llm.generate(prompts, kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    int8 = sum(agreement(d.token_ids, e) for d, e in zip(done, exact, strict=True)) / len(prompts)
    own = sum(agreement(eager_greedy(plain, p, NEW_TOKENS), e) for p, e in zip(prompts, exact, strict=True)) / len(prompts)
    assert int8 >= 0.7 * own and int8 >= NEW_TOKENS / 2


def test_the_engine_runs_what_the_quantized_module_computes(int8_llm, eager_greedy):
    prompt = token_stream(8, seed=1)
    done = int8_llm.generate([prompt], kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert agreement(done[0].token_ids, eager_greedy(int8_llm.model, prompt, NEW_TOKENS)) >= NEW_TOKENS // 2


@pytest.mark.slow
def test_int8_with_the_lm_head_quantized_is_precompiled_and_a_second_engine_loads_it(tmp_path, monkeypatch):
    """Every linear is kvgraph's int8 op, so the weights stay graph inputs (unfrozen by default) and
    a second engine of the same settings loads its graph (every step's) whole, with the same tokens."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    settings = dict(dtype=torch.bfloat16, quantization=SCHEME, quantize_lm_head=True, max_batch_size=4,
                    max_seq_len=64, progress=False)
    prompts = [token_stream(8, seed) for seed in range(2)]
    tokens = []
    for note in ("1 graph compiled and written to precompiled files", "1 graph loaded whole from precompiled files"):
        llm = kvgraph.LLM("llama-tiny", **settings)
        try:
            llm.warmup()
            assert llm.startup_note().startswith(note)
            done = llm.generate(prompts, kvgraph.SamplingParams(max_new_tokens=6, ignore_eos=True))
            assert llm.stats()["recompiles"] == 0
            tokens.append([c.token_ids for c in done])
        finally:
            llm.close()
    assert tokens[0] == tokens[1]


# -- Inductor: frozen weights, no recompiles, the C++ attention kernel --
@pytest.mark.slow
def test_inductor_freezes_the_int8_weights_without_recompiles_on_the_cpp_kernel(monkeypatch):
    monkeypatch.setenv("KVGRAPH_CPU_ATTENTION", "cpp")
    monkeypatch.setattr(attention, "_cpu_run", None)  # choose the CPU implementation afresh
    llm = kvgraph.LLM(bf16("llama-tiny", SCHEME, lm_head=True), compile="inductor", freeze_weights=True,
                      max_batch_size=4, max_seq_len=64, progress=False)
    llm.warmup()
    prompts = [token_stream(8, seed) for seed in range(3)]
    steps = llm.stats()["steps"]
    with torch.profiler.profile(record_shapes=True) as prof:
        done = llm.generate(prompts, kvgraph.SamplingParams(max_new_tokens=12, ignore_eos=True))
    stats = llm.stats()
    assert stats["warmup_graphs"] == 2 and stats["recompiles"] == 0
    assert attention.cpu_implementation() == "cpp"
    # every quantized linear of every step ran kvgraph's int8 routing, in C++: 7 per layer and the lm_head
    assert not [e for e in prof.events() if e.name == "kvgraph::int8_weight_linear"]
    calls = [e for e in prof.events() if e.name == "kvgraph_cpu::int8_weight_linear"]
    assert len(calls) == (7 * 2 + 1) * (stats["steps"] - steps)
    # and the lm_head's rows were pruned to one per sequence (prune_logits saw the op as a projection)
    head_rows = {e.input_shapes[0][-2] for e in calls if e.input_shapes[1][0] == llm.vocab_size}
    assert max(head_rows) <= len(prompts)
    eager = kvgraph.LLM(bf16("llama-tiny", SCHEME, lm_head=True), compile="eager", max_batch_size=4,
                        max_seq_len=64, progress=False)
    again = eager.generate(prompts, kvgraph.SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert all(agreement(a.token_ids, b.token_ids) >= 6 for a, b in zip(done, again, strict=True))
