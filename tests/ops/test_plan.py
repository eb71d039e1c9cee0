"""The op's schema and per-step plan: one argument list, the step's metadata checked once per bound step."""

from __future__ import annotations

import torch

from kvgraph.errors import CacheInputError
from kvgraph.ops import SCHEMA, AttentionArgs, StepPlan, bound_step
from kvgraph.ops.reference import ragged_attention as reference_attention
from tests.naming import raises_naming


def _count_builds(monkeypatch) -> list[StepPlan]:
    """Record every plan :meth:`StepPlan.build` returns."""
    built: list[StepPlan] = []
    build = StepPlan.build.__func__

    def counting(cls, args):
        plan = build(cls, args)
        built.append(plan)
        return plan

    monkeypatch.setattr(StepPlan, "build", classmethod(counting))
    return built


def _bound(case):
    return bound_step(case.kv_blocks, case.cache_lengths, case.lookup_table, case.input_row_offsets,
                      case.max_lengths)


def test_schema_is_generated_from_the_argument_list():
    assert SCHEMA.startswith("(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_blocks,")
    assert SCHEMA.endswith("float? softcap=None, Tensor(b!)? kv_scales=None) -> Tensor")
    declared = torch.ops.kvgraph.ragged_attention.default._schema
    assert [a.name for a in declared.arguments] == list(AttentionArgs._fields)


def test_plan_is_reused_across_the_layers_of_a_bound_step(monkeypatch, make_kv_case):
    case = make_kv_case([(4, 7), (3, 1)], num_layers=3)
    built = _count_builds(monkeypatch)
    expected = [reference_attention(*case.clone().args()[:8], layer) for layer in range(3)]
    assert len(built) == 3  # outside a bound step every call is checked in full
    built.clear()
    with _bound(case):
        outs = [torch.ops.kvgraph.ragged_attention(*case.args()[:8], layer) for layer in range(3)]
    assert len(built) == 1
    for out, want in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, want)


def test_plan_is_invalidated_by_a_new_step_and_by_other_tensors(monkeypatch, make_kv_case):
    case = make_kv_case([(2, 5)], num_layers=2)
    built = _count_builds(monkeypatch)
    with _bound(case):
        torch.ops.kvgraph.ragged_attention(*case.args())
    with _bound(case):
        torch.ops.kvgraph.ragged_attention(*case.args())
        args = list(case.args())
        args[4] = case.cache_lengths.clone()  # not the bound tensor: checked on its own
        torch.ops.kvgraph.ragged_attention(*args)
    assert len(built) == 3


def test_a_bad_step_is_refused_at_its_first_layer_with_nothing_written(make_kv_case):
    case = make_kv_case([(4, 7), (3, 1)], num_layers=2)
    case.lookup_table = case.lookup_table.long()
    before = case.kv_blocks.clone()
    with _bound(case), raises_naming(CacheInputError, "lookup_table dtype torch.int64", "torch.int32"):
        torch.ops.kvgraph.ragged_attention(*case.args())
    assert torch.equal(case.kv_blocks, before)


def test_layer_checks_still_run_within_a_bound_step(make_kv_case):
    case = make_kv_case([(4, 7)], num_layers=2)
    with _bound(case):
        torch.ops.kvgraph.ragged_attention(*case.args())
        with raises_naming(CacheInputError, "layer_idx 2", "kv_blocks", "2 layers"):
            torch.ops.kvgraph.ragged_attention(*case.args()[:8], 2)
        with raises_naming(CacheInputError, "k dtype torch.float64", "q dtype torch.float32"):

            torch.ops.kvgraph.ragged_attention(case.q, case.k.double(), *case.args()[2:])
