import pytest
import torch

from kvgraph.engine import sampling
from kvgraph.engine.sampling import SamplingParams, filter_logits, greedy_tokens, sample
from kvgraph.errors import ConfigError


def _logits(rows: int = 3, vocab: int = 97, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_per_row():
    logits = _logits()
    params = [SamplingParams()] * 3
    assert torch.equal(sample(logits, params, [None] * 3).tokens, logits.argmax(-1))


def test_greedy_takes_the_first_of_tied_maxima_and_a_nan():
    logits = torch.zeros(3, 40000)
    logits[0, [7, 30000]] = 2.0  # a tie: the lower id wins, as torch.argmax
    logits[1, 123] = float("nan")  # NaN counts as the largest, as in torch.argmax
    greedy = [SamplingParams(temperature=0.0)] * 3
    out = sample(logits, greedy, [None] * 3)
    assert out.tokens.tolist() == [7, 123, 0] == torch.argmax(logits, dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_greedy_tokens_with_and_without_the_cpp_kernel(monkeypatch, dtype):
    """float32, bfloat16 and float16 on the CPU go to kvgraph's argmax_rows where it builds (the
    half types widened exactly), float64 to torch.max: the same tokens either way, ties included."""
    logits = _logits(rows=9, vocab=1000).to(dtype)
    logits[2, [10, 600]] = 50.0
    logits[4, 77] = float("nan")
    want = logits.max(dim=-1).indices
    assert torch.equal(greedy_tokens(logits), want)
    if dtype is not torch.float64:
        from kvgraph.ops import cpp

        assert sampling._argmax_rows == [cpp.argmax_kernel()]  # looked up once, the C++ op where it builds
    monkeypatch.setattr(sampling, "_argmax_rows", [None])  # as where the library does not build
    assert torch.equal(greedy_tokens(logits), want)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1),
                                    SamplingParams(temperature=2.0, top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_reduce_to_greedy(params):
    logits = _logits()
    gens = [params.generator(logits.device) for _ in range(3)]
    assert torch.equal(sample(logits, [params] * 3, gens).tokens, logits.argmax(-1))


def test_top_k_keeps_exactly_k():
    logits = _logits(1)[0]
    kept = torch.isfinite(filter_logits(logits, 5, 1.0))
    assert kept.sum() == 5
    assert set(kept.nonzero().flatten().tolist()) == set(logits.topk(5).indices.tolist())


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(filter_logits(logits, None, 0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, None, 0.81)).tolist() == [True, True, True, False]


def test_seeded_sampling_is_reproducible_and_independent_of_batch_neighbours():
    logits = _logits(4, seed=1)
    p = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0, seed=99)
    draws = []
    for _ in range(2):
        g = p.generator(logits.device)
        draws.append([sample(logits[:1], [p], [g]).tokens.item() for _ in range(20)])
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1  # really sampling, not argmax
    # the same request next to a different neighbour draws the same tokens
    g, h = p.generator(logits.device), other.generator(logits.device)
    mixed = [sample(torch.cat([logits[:1], logits[1:2]]), [p, other], [g, h]).tokens[0].item() for _ in range(20)]
    assert mixed == draws[0]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0, seed=0)
    g = p.generator(logits.device)
    counts = torch.bincount(torch.stack([sample(logits, [p], [g]).tokens for _ in range(2000)]).flatten(), minlength=3)
    freq = counts.float() / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), r"max_new_tokens.*>= 1.*\b0\b"),
        (dict(temperature=-0.5), r"temperature.*>= 0.*-0\.5"),
        (dict(top_k=0), r"top_k.*>= 1.*\b0\b"),
        (dict(top_p=0.0), r"top_p.*\(0, 1\].*\b0\.0\b"),
        (dict(top_p=1.5), r"top_p.*\(0, 1\].*\b1\.5\b"),
        (dict(seed="x"), "seed.*'x'"),
        (dict(stop_token_ids=[3, -1]), r"stop_token_ids.*-1\b"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2.0, 2.0\], got 2.5"),
        (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2.0, 2.0\], got -3"),
        (dict(frequency_penalty=float("nan")), r"frequency_penalty must be in \[-2.0, 2.0\], got nan"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0, got 0.0"),
        (dict(logit_bias={5: 101.0}), r"logit_bias of token 5 must be in \[-100.0, 100.0\], got 101.0"),
        (dict(logit_bias={-1: 1.0}), r"logit_bias keys must be token ids \(ints >= 0\), got -1"),
        (dict(logit_bias={"7": 1.0}), r"logit_bias keys must be token ids \(ints >= 0\), got '7'"),
        (dict(logit_bias=5), r"logit_bias must map token ids to biases, got 5"),
        (dict(min_tokens=5, max_new_tokens=4), r"min_tokens must be an int in \[0, max_new_tokens=4\], got 5"),
        (dict(min_tokens=-1), r"min_tokens must be an int in \[0, max_new_tokens=16\], got -1"),
        (dict(logprobs=21), r"logprobs must be None or an int in \[0, 20\], got 21"),
        (dict(logprobs=-1), r"logprobs must be None or an int in \[0, 20\], got -1"),
    ],
)
def test_bad_sampling_params_raise_with_the_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


def test_sample_checks_row_counts():
    with pytest.raises(ConfigError, match=r"\b2 logit rows, 1 params"):
        sample(_logits(2), [SamplingParams()], [None])


def test_logit_bias_is_stored_sorted_by_id():
    assert SamplingParams(logit_bias={9: 1.0, 2: -3.0}).logit_bias == ((2, -3.0), (9, 1.0))


def test_only_the_rows_that_ask_get_logprobs():
    logits = _logits(3)
    params = [SamplingParams(), SamplingParams(logprobs=4), SamplingParams(logprobs=0)]
    out = sample(logits, params, [None] * 3)
    assert out.logprobs.rows == [1, 2]
    assert sample(logits, [SamplingParams()] * 3, [None] * 3).logprobs is None


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_the_log_softmax_at_the_temperature_before_top_k(temperature):
    logits = _logits(2, seed=3)
    p = SamplingParams(temperature=temperature, top_k=2, logprobs=5, seed=0)
    out = sample(logits, [p, p], [p.generator(logits.device) for _ in range(2)])
    expected = torch.log_softmax(logits / (temperature or 1.0), dim=-1)  # top_k leaves these unchanged
    assert torch.allclose(out.logprobs.chosen, expected.gather(1, out.tokens[:, None])[:, 0], atol=1e-6)
    top = expected.topk(5)
    assert torch.equal(out.logprobs.top_ids, top.indices)
    assert torch.allclose(out.logprobs.top_logprobs, top.values, atol=1e-6)


def test_per_row_logprobs_keep_what_each_row_asked_and_the_greedy_token_leads():
    logits = _logits(2, seed=4)
    params = [SamplingParams(logprobs=3), SamplingParams(logprobs=1)]
    out = sample(logits, params, [None, None])
    rows = out.logprobs.per_row(params)
    assert [len(rows[0].top), len(rows[1].top)] == [3, 1]
    for b in (0, 1):
        values = [v for _, v in rows[b].top]
        assert values == sorted(values, reverse=True)
        assert rows[b].top[0] == (out.tokens[b].item(), rows[b].logprob)
