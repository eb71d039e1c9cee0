"""Arguments the Triton kernels cannot take raise CacheInputError naming the value, and nothing is written."""

import pytest
import torch

import kvgraph.ops.triton.checks as checks
from kvgraph.errors import CacheInputError
from kvgraph.ops.plan import plan_for
from kvgraph.ops.schema import AttentionArgs
from kvgraph.ops.triton import ragged_attention
from tests.naming import raises_naming
from tests.ops.triton.triton_cases import DEVICE


def _with(args, **changes):
    return AttentionArgs(*args)._replace(**changes)


def launch_plan(*args, **kwargs) -> checks.LaunchPlan:
    """The Triton launch plan of the op's arguments, checked as the op checks them."""
    op_args = AttentionArgs(*args, **kwargs)
    return checks.check_launch(op_args, plan_for(op_args))


BAD = {
    "float64": (lambda a: _with(a, q=a[0].double(), k=a[1].double(), v=a[2].double(), kv_blocks=a[3].double()),
                ("dtype torch.float64", "Triton")),
    "q_not_contiguous_in_head_dim": (lambda a: _with(a, q=a[0].transpose(1, 2).contiguous().transpose(1, 2)),
                                     ("q", "contiguous", "head_dim")),
    "strided_cache_lengths": (lambda a: _with(a, cache_lengths=a[4].repeat_interleave(2)[::2]),
                              ("cache_lengths", "contiguous")),
    "no_new_tokens_claimed": (lambda a: _with(a, max_lengths=torch.tensor([[0, 9]], dtype=torch.int32)),
                              ("max_lengths[0, 0] = 0", "[1, 5]")),
    "more_new_tokens_than_the_batch": (lambda a: _with(a, max_lengths=torch.tensor([[6, 9]], dtype=torch.int32)),
                                       ("max_lengths[0, 0] = 6", "[1, 5]")),
    "context_beyond_the_lookup_table": (lambda a: _with(a, max_lengths=torch.tensor([[3, 10_000]], dtype=torch.int32)),
                                        ("max_lengths[0, 1] = 10000", "32 positions")),
    "bool_layer": (lambda a: _with(a, layer_idx=True), ("layer_idx", "int", "True")),
    "dtype_mismatch": (lambda a: _with(a, k=a[1].half()), ("k dtype torch.float16", "q dtype torch.float32")),
    "layer_out_of_range": (lambda a: _with(a, layer_idx=2), ("layer_idx 2", "2 layers")),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments_raise_and_leave_the_cache_unchanged(make_kv_case, name):
    # 16-token pages, lookup table of 2 columns: one sequence holds at most 32 positions
    case = make_kv_case([(4, 3), (9, 2)], device=DEVICE)
    before = case.kv_blocks.clone()
    corrupt, names = BAD[name]
    with raises_naming(CacheInputError, *names):
        ragged_attention(*corrupt(case.args()))
    assert torch.equal(case.kv_blocks, before)


def test_head_dim_above_the_kernel_limit(make_kv_case):
    case = make_kv_case([(1, 1)], head_dim=checks.MAX_HEAD_DIM + 8, device=DEVICE)
    with raises_naming(CacheInputError, "head_dim 264", "Triton", str(checks.MAX_HEAD_DIM)):
        ragged_attention(*case.args())


def test_cpu_tensors_need_the_interpreter(make_kv_case, monkeypatch):
    monkeypatch.setattr(checks, "interpreting", lambda: False)
    case = make_kv_case([(1, 1)])
    with raises_naming(CacheInputError, "CUDA", "TRITON_INTERPRET=1", "cpu"):
        ragged_attention(*case.args())


def test_default_scale_is_inverse_sqrt_head_dim(make_kv_case):
    case = make_kv_case([(1, 2)], head_dim=64, device=DEVICE)
    assert launch_plan(*case.args()).scale == pytest.approx(0.125)
    assert launch_plan(*case.args(), scale=0.5).scale == 0.5


BAD_OPTIONS = [("sliding_window", w) for w in (0, -3, True, 2.5)] + [
    ("softcap", c) for c in (0.0, 0, -1.0, float("nan"), float("inf"), -float("inf"))
]


@pytest.mark.parametrize(("option", "value"), BAD_OPTIONS)
def test_bad_window_or_softcap_is_refused_before_anything_is_written(make_kv_case, option, value):
    case = make_kv_case([(4, 3), (9, 2)], device=DEVICE)
    before = case.kv_blocks.clone()
    with raises_naming(CacheInputError, option, repr(value)):
        launch_plan(*case.args(), **{option: value})
    with raises_naming(CacheInputError, option, repr(value)):

        ragged_attention(*case.args(), **{option: value})
    assert torch.equal(case.kv_blocks, before)


def test_sliding_window_as_the_kernels_take_it(make_kv_case):
    # 16-token pages, lookup table of 2 columns: a window of 32 or more hides nothing (0)
    case = make_kv_case([(4, 3), (9, 2)], device=DEVICE)
    plans = {w: launch_plan(*case.args(), sliding_window=w) for w in (None, 1, 5, 31, 32, 10**12)}
    assert {w: p.window for w, p in plans.items()} == {None: 0, 1: 1, 5: 5, 31: 31, 32: 0, 10**12: 0}
    # keys one query attends, which sizes the decode splits: the longest context 11, or the window
    assert {w: p.max_keys for w, p in plans.items()} == {None: 11, 1: 1, 5: 5, 31: 11, 32: 11, 10**12: 11}


def test_softcap_as_the_kernels_take_it(make_kv_case):
    case = make_kv_case([(4, 3), (9, 2)], device=DEVICE)
    assert launch_plan(*case.args()).softcap is None
    plan = launch_plan(*case.args(), softcap=30)
    assert plan.softcap == 30.0 and isinstance(plan.softcap, float)
    assert launch_plan(*case.args(), softcap=0.5, sliding_window=5).softcap == 0.5
