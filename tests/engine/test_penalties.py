import math
from types import SimpleNamespace

import pytest
import torch

from kvgraph.engine.penalties import LogitsProcessor
from kvgraph.engine.sampling import SamplingParams, sample

V = 11
EOS = 2
CPU = torch.device("cpu")


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def _row(prompt=(), output=(), eos=(EOS,)):
    return SimpleNamespace(prompt_ids=list(prompt), output_ids=list(output), eos_token_ids=eos)


def _apply(logits: torch.Tensor, params, rows) -> torch.Tensor:
    processor = LogitsProcessor.build(params, rows, V, CPU)
    return logits.float() if processor is None else processor(logits)


def test_no_row_with_penalties_builds_nothing():
    assert LogitsProcessor.build([SamplingParams(), SamplingParams(temperature=1.0)], [None, None], V, CPU) is None


def test_frequency_penalty_subtracts_once_per_generated_time():
    logits = _logits(1)
    p = SamplingParams(frequency_penalty=0.5)
    out = _apply(logits, [p], [_row(prompt=[4, 4, 4], output=[7, 7, 3])])
    delta = out - logits
    assert delta[0, 7].item() == pytest.approx(-1.0, abs=1e-6)  # generated twice
    assert delta[0, 3].item() == pytest.approx(-0.5, abs=1e-6)
    assert delta[0, 4].item() == 0.0  # the prompt does not count
    # so the twice-generated token's probability (against an untouched one) falls by e^-1
    before, after = torch.softmax(logits, -1)[0], torch.softmax(out, -1)[0]
    assert (after[7] / after[0]).item() == pytest.approx((before[7] / before[0]).item() * math.exp(-1.0), rel=1e-5)


def test_presence_penalty_subtracts_once_whatever_the_count():
    logits = _logits(1)
    out = _apply(logits, [SamplingParams(presence_penalty=-0.75)], [_row(prompt=[5], output=[7, 7, 3])])
    delta = (out - logits)[0]
    assert delta[7].item() == pytest.approx(0.75) and delta[3].item() == pytest.approx(0.75)
    assert delta[5].item() == 0.0 and delta.count_nonzero() == 2


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 0, 0, 0, 0, 0, 0]])
    out = _apply(logits, [SamplingParams(repetition_penalty=2.0)], [_row(prompt=[0, 1], output=[3])])
    assert out[0, :5].tolist() == [1.0, -4.0, 2.0, -4.0, 1.0]


def test_logit_bias_adds_and_minus_100_bans():
    logits = _logits(1)
    banned = int(logits.argmax())
    p = SamplingParams(logit_bias={banned: -100.0, 1: 0.5})
    out = _apply(logits, [p], [_row()])
    assert (out - logits)[0, 1].item() == pytest.approx(0.5)
    assert sample(out, [p], [None]).tokens.item() != banned
    sp = SamplingParams(temperature=1.0, seed=0, logit_bias={banned: -100.0})
    gen = sp.generator(CPU)
    draws = [sample(_apply(logits, [sp], [_row()]), [sp], [gen]).tokens.item() for _ in range(200)]
    assert banned not in draws


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0  # EOS would win
    p = SamplingParams(min_tokens=3, stop_token_ids=(5,))
    processor = LogitsProcessor.build([p], [_row(output=[8])], V, CPU)
    picked = []
    for _ in range(3):
        out = processor(logits)
        token = sample(out, [p], [None]).tokens
        picked.append(token.item())
        processor.advance(token)
        if len(picked) <= 2:
            assert out[0, EOS] == float("-inf") and out[0, 5] == float("-inf")
    assert EOS not in picked[:2]
    assert picked[2] == EOS  # the third token is the request's 3rd generated one: allowed again


def test_min_tokens_leaves_eos_alone_with_ignore_eos():
    logits = _logits(1)
    out = _apply(logits, [SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=(4,))], [_row()])
    assert out[0, 4] == float("-inf") and out[0, EOS] == logits[0, EOS]


def test_advance_counts_the_new_tokens():
    logits = torch.ones(2, V)
    params = [SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=2.0), SamplingParams()]
    processor = LogitsProcessor.build(params, [_row(), _row()], V, CPU)
    processor.advance(torch.tensor([6, 6]))
    processor.advance(torch.tensor([6, 3]))
    out = processor(logits)
    assert out[0, 6].item() == 0.5 - 2.0 - 0.5  # halved, twice generated, present
    assert out[0, 3].item() == 1.0 and torch.equal(out[1], logits[1])


MIXED = [
    SamplingParams(),
    SamplingParams(frequency_penalty=0.4, presence_penalty=0.3, logprobs=3),
    SamplingParams(temperature=0.8, seed=5, repetition_penalty=1.3, logit_bias={3: 2.0}),
    SamplingParams(temperature=1.0, seed=9, top_k=4),
    SamplingParams(min_tokens=2, logit_bias={0: -5.0}),
]
ROWS = [_row([1, 2], [3]), _row([4], [4, 4, 9]), _row([3, 3], [1]), _row([5], []), _row([6], [])]


def test_each_row_of_a_mixed_batch_gets_what_it_gets_alone():
    logits = _logits(len(MIXED), seed=2)
    together = sample(_apply(logits, MIXED, ROWS), MIXED, [p.generator(CPU) for p in MIXED])
    lp = together.logprobs.per_row(MIXED)
    for b, (p, row) in enumerate(zip(MIXED, ROWS, strict=True)):
        alone = sample(_apply(logits[b : b + 1], [p], [row]), [p], [p.generator(CPU)])
        assert alone.tokens.item() == together.tokens[b].item()
        if p.logprobs is not None:
            assert alone.logprobs.per_row([p])[0] == lp[b]


def test_seeded_penalized_rows_are_reproducible():
    logits = _logits(len(MIXED), seed=7)

    def run():
        gens = [p.generator(CPU) for p in MIXED]
        processor = LogitsProcessor.build(MIXED, ROWS, V, CPU)
        tokens = []
        for _ in range(10):
            picked = sample(processor(logits), MIXED, gens).tokens
            processor.advance(picked)
            tokens.append(picked.tolist())
        return tokens

    assert run() == run()


def test_rows_without_penalties_are_left_bit_for_bit():
    logits = _logits(3)
    params = [SamplingParams(), SamplingParams(frequency_penalty=2.0), SamplingParams(temperature=0.5)]
    out = _apply(logits, params, [_row(output=[1]), _row(output=[1]), _row(output=[1])])
    assert torch.equal(out[[0, 2]], logits[[0, 2]]) and not torch.equal(out[1], logits[1])
