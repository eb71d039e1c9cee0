"""Explaining greedy mismatches by ties within the reference model's own rounding error."""

from types import SimpleNamespace

import pytest
import torch

from kvgraph.entrypoints.cli.bench import agreement_text
from kvgraph.entrypoints.cli.divergence import explain, first_divergence, ulp


class _FixedLogits(torch.nn.Module):
    """A causal LM stand-in whose next-token logits are a fixed row per context length."""

    def __init__(self, rows: dict[int, list[float]], dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.rows = rows
        self.seen: list[list[int]] = []

    def forward(self, input_ids, use_cache=False):
        self.seen.append(input_ids[0].tolist())
        row = torch.tensor(self.rows[input_ids.shape[1]], dtype=torch.float64)
        return SimpleNamespace(logits=row.expand(1, input_ids.shape[1], -1))


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_ulp_of_common_dtypes():
    assert ulp(9.5, torch.bfloat16) == 2.0**-4
    assert ulp(1.0, torch.float32) == 2.0**-23
    assert ulp(-3.0, torch.float16) == 2.0**-9


def test_a_gap_of_one_ulp_is_within_rounding_even_with_little_noise():
    # best 4.25: one bf16 ulp is 2**-5; the measured noise alone (0.01) would not cover it
    model = _FixedLogits({2: [4.25, 4.25 - 2.0**-5, 1.0]})
    exact = _FixedLogits({2: [4.25, 4.25 - 2.0**-5 + 0.01, 1.0]}, torch.float64)
    [d] = explain(model, [[7, 7]], [[1]], [[0]], exact=exact)
    assert d["bound"] == 2.0**-5 and d["within_rounding"]
    two_ulps = _FixedLogits({2: [4.25, 4.25 - 2.0**-4, 1.0]})
    close = _FixedLogits({2: [4.25, 4.25 - 2.0**-4 + 0.01, 1.0]}, torch.float64)
    assert not explain(two_ulps, [[7, 7]], [[1]], [[0]], exact=close)[0]["within_rounding"]


def test_a_gap_below_the_rounding_error_is_within_rounding():
    # the run dtype's logits vs float64: an error of 0.1 on token 1, so the 0.125 gap is a tie
    model = _FixedLogits({3: [9.5, 9.375, 1.0, 0.0]})
    exact = _FixedLogits({3: [9.5, 9.475, 1.0, 0.0]}, torch.float64)
    [d] = explain(model, [[7, 7]], [[5, 1, 0]], [[5, 0, 0]], exact=exact)
    assert model.seen == exact.seen == [[7, 7, 5]]  # prompt + the agreed prefix
    assert (d["request"], d["token"], d["ours"], d["theirs"], d["best"]) == (0, 1, 1, 0, 0)
    assert d["gap_ours"] == pytest.approx(0.125) and d["gap_theirs"] == 0.0
    assert d["noise"] == pytest.approx(0.1) and d["within_rounding"]


def test_a_gap_above_the_rounding_error_is_not():
    model = _FixedLogits({2: [9.5, 9.375, 9.0, 0.0]})
    exact = _FixedLogits({2: [9.5, 9.4, 9.0, 0.0]}, torch.float64)
    assert not explain(model, [[7, 7]], [[1]], [[0]], exact=exact)[0]["within_rounding"]  # 0.125 > 2 * 0.025
    noisy = _FixedLogits({2: [9.5, 9.375, 9.3, 0.0]}, torch.float64)
    assert explain(model, [[7, 7]], [[2]], [[0]], exact=noisy)[0]["within_rounding"]  # 0.5 <= 2 * 0.3
    assert explain(model, [[7, 7]], [[0]], [[0]], exact=exact) == []


def test_the_default_exact_model_is_a_float64_copy():
    model = torch.nn.Linear(3, 4).to(torch.bfloat16)
    with torch.no_grad():  # 1 + 2**-9 is 1 in bfloat16 (8 significant bits): a rounding error of 2**-9
        model.weight.fill_(1.0)
        model.bias.fill_(2.0**-9)

    class Wrapped(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, input_ids, use_cache=False):
            x = torch.nn.functional.one_hot(input_ids, 3).to(self.lin.weight.dtype)
            return SimpleNamespace(logits=self.lin(x))

    wrapped = Wrapped(model)
    [d] = explain(wrapped, [[0, 1]], [[1]], [[2]])
    assert d["noise"] == 2.0**-9 and wrapped.lin.weight.dtype == torch.bfloat16  # the model itself is untouched


def test_agreement_text_names_what_is_not_explained():
    a = {"system": "hf-generate", "identical": 1, "requests": 3, "within_rounding": 1, "divergences": [
        {"request": 1, "token": 4, "ours": 1, "theirs": 0, "gap_ours": 0.1, "gap_theirs": 0.0, "noise": 0.1,
         "within_rounding": True},
        {"request": 2, "token": 0, "ours": 9, "theirs": 0, "gap_ours": 2.5, "gap_theirs": 0.0, "noise": 0.1,
         "within_rounding": False},
    ]}
    text = agreement_text(a)
    assert text.startswith("greedy outputs vs hf-generate: 1/3 requests identical; 1 part where both tokens'")
    assert "1 otherwise (request 2 token 0: kvgraph 9, hf-generate 0, logit gaps to the best 2.5 / 0" in text
