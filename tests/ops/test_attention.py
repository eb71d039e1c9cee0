"""The custom op: registration, schema, opcheck, torch.compile, fake impl, input errors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from kvgraph.errors import CacheInputError
from kvgraph.ops import attention, check_inputs, cpp, cpu, reference
from tests.naming import raises_naming

OP = torch.ops.kvgraph.ragged_attention


def test_schema_is_the_contract():
    assert str(OP.default._schema) == (
        "kvgraph::ragged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_blocks, "
        "Tensor cache_lengths, Tensor lookup_table, Tensor input_row_offsets, Tensor max_lengths, "
        "int layer_idx, float? scale=None, int? sliding_window=None, float? softcap=None, "
        "Tensor(b!)? kv_scales=None) -> Tensor"
    )


def test_cpu_and_cuda_kernels_are_registered():
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("kvgraph::ragged_attention", key), key


def test_op_runs_the_chosen_cpu_path_and_mutates_the_cache(make_kv_case, cache_page_size):
    case = make_kv_case([(20, 1), (0, 17), (7, 9)], page_size=cache_page_size)
    before = case.kv_blocks.clone()
    fast = case.clone()
    chosen = {"cpp": cpp.ragged_attention, "sdpa": cpu.ragged_attention}[attention.cpu_implementation()]
    expected = chosen(*fast.args(), scale=0.2)
    out = OP(*case.args(), scale=0.2)
    assert torch.equal(out, expected)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))


@pytest.mark.parametrize("page_size", [4, None], ids=["paged", "continuous"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_opcheck(make_kv_case, page_size, scale):
    case = make_kv_case([(5, 3), (0, 7), (9, 1)], page_size=page_size)
    torch.library.opcheck(OP.default, case.args(), {"scale": scale})


@pytest.mark.parametrize("page_size", [4, None], ids=["paged", "continuous"])
def test_opcheck_with_a_sliding_window(make_kv_case, page_size):
    case = make_kv_case([(5, 3), (0, 7), (9, 1)], page_size=page_size)
    torch.library.opcheck(OP.default, case.args(), {"sliding_window": 3})


@pytest.mark.parametrize("page_size", [4, None], ids=["paged", "continuous"])
def test_opcheck_with_a_softcap(make_kv_case, page_size):
    case = make_kv_case([(5, 3), (0, 7), (9, 1)], page_size=page_size)
    torch.library.opcheck(OP.default, case.args(), {"sliding_window": 3, "softcap": 5.0})


@pytest.mark.parametrize("page_size", [4, None], ids=["paged", "continuous"])
def test_torch_compile_fullgraph_mutates_kv_blocks(make_kv_case, check_against_golden, page_size):
    case = make_kv_case([(5, 3), (0, 7), (9, 1)], page_size=page_size)
    before = case.kv_blocks.clone()
    ref = reference.ragged_attention(*case.clone().args())

    def step(q, k, v, kv_blocks, cache_lengths, lookup_table, input_row_offsets, max_lengths):
        out = OP(q, k, v, kv_blocks, cache_lengths, lookup_table, input_row_offsets, max_lengths, 1)
        return out * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(*case.args()[:-1])
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))
    check_against_golden(out / 2.0, case.golden(), ref)


def test_fake_impl_gives_the_output_shape(make_kv_case):
    case = make_kv_case([(5, 3), (0, 7)])
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in case.args()]
        out = OP(*fakes)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype


def test_fake_impl_rejects_a_wrong_rank(make_kv_case):
    case = make_kv_case([(5, 3)])
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in case.args()]
        fakes[0] = fakes[0][0]
        with raises_naming(CacheInputError, "q", "rank 3", "rank 2"):
            OP(*fakes)


def _set(**changes):
    """An edit of a KVCase: each value is a function of the case giving the new attribute."""

    def edit(case):
        for name, fn in changes.items():
            setattr(case, name, fn(case))

    return edit


BAD_METADATA = {
    "q_rank": (_set(q=lambda c: c.q[None]), ("q", "rank 3", "rank 4")),
    "blocks_rank": (_set(kv_blocks=lambda c: c.kv_blocks[0]), ("kv_blocks", "rank 6", "rank 5")),
    "lookup_rank": (_set(lookup_table=lambda c: c.lookup_table[..., None]), ("lookup_table", "rank 2", "rank 3")),
    "heads_not_multiple": (_set(q=lambda c: c.q[:, :3]), ("q heads 3", "k/v heads 2")),
    "head_dim_mismatch": (_set(q=lambda c: c.q[..., :8]), ("k head_dim 16", "q head_dim 8")),
    "k_v_shapes": (_set(v=lambda c: c.v[:, :1]), ("k shape (8, 2, 16)", "v shape (8, 1, 16)")),
    "tokens_mismatch": (_set(k=lambda c: c.k[:-1], v=lambda c: c.v[:-1]), ("k", "7 tokens", "q", "8")),
    "blocks_heads": (_set(kv_blocks=lambda c: c.kv_blocks[..., :1, :]), ("kv_blocks", "k/v heads 2")),
    "layer_out_of_range": (_set(layer_idx=lambda c: 2), ("layer_idx 2", "kv_blocks", "2 layers")),
    "negative_layer": (_set(layer_idx=lambda c: -1), ("layer_idx -1",)),
    "offsets_length": (_set(input_row_offsets=lambda c: c.input_row_offsets[:-1]),
                       ("input_row_offsets", "2 entries", "batch + 1 = 3")),
    "lookup_rows": (_set(lookup_table=lambda c: c.lookup_table[:1]), ("lookup_table", "1 rows", "batch", "2")),
    "dtype_mismatch": (_set(k=lambda c: c.k.double()), ("k dtype torch.float64", "q dtype torch.float32")),
    "int_q": (_set(q=lambda c: c.q.int()), ("q dtype torch.int32", "torch.float32")),
    "int64_index": (_set(cache_lengths=lambda c: c.cache_lengths.long()), ("cache_lengths dtype torch.int64", "torch.int32")),
    "max_lengths_shape": (_set(max_lengths=lambda c: c.max_lengths[:, :1]), ("max_lengths", "[num_steps >= 1, 2]")),
}

BAD_VALUES = {
    "max_lengths_too_small": (_set(max_lengths=lambda c: c.max_lengths - 1),
                              ("max_lengths[0] = [6, 10]", "[7, 11]")),
    "offsets_do_not_end_at_T": (_set(input_row_offsets=lambda c: c.input_row_offsets.clamp(max=6)),
                                ("input_row_offsets", "token count 8", "0..6")),
    "offsets_decrease": (_set(input_row_offsets=lambda c: torch.tensor([0, 9, 8], dtype=torch.int32)),
                         ("input_row_offsets", "sequence 1", "9 -> 8")),
    "negative_cache_length": (_set(cache_lengths=lambda c: torch.tensor([-1, 0], dtype=torch.int32)),
                              ("cache_lengths", ">= 0", "[-1, 0]")),
    "too_few_lookup_columns": (_set(lookup_table=lambda c: c.lookup_table[:, :2]),
                               ("sequence 0", "3 pages", "11 tokens", "lookup_table", "2 columns")),
    "unused_page_in_use": (_set(lookup_table=lambda c: c.lookup_table.index_fill(1, torch.tensor([2]), 99)),
                           ("lookup_table[0, 2] = 99", "[0, ")),
}


@pytest.mark.parametrize("edit,names", list(BAD_METADATA.values()), ids=list(BAD_METADATA))
def test_bad_metadata_raises_and_leaves_the_cache_unchanged(make_kv_case, edit, names):
    case = make_kv_case([(4, 7), (3, 1)], page_size=4)
    blocks, before = case.kv_blocks, case.kv_blocks.clone()
    edit(case)
    with raises_naming(CacheInputError, *names):
        OP(*case.args())
    with raises_naming(CacheInputError, *names):
        reference.ragged_attention(*case.args())
    assert torch.equal(blocks, before)


@pytest.mark.parametrize("edit,names", list(BAD_VALUES.values()), ids=list(BAD_VALUES))
def test_bad_index_values_raise_and_leave_the_cache_unchanged(make_kv_case, edit, names):
    case = make_kv_case([(4, 7), (3, 1)], page_size=4)
    before = case.kv_blocks.clone()
    edit(case)
    with raises_naming(CacheInputError, *names):
        OP(*case.args())
    assert torch.equal(case.kv_blocks, before)


def test_continuous_sequence_past_max_seq_len(make_kv_case):
    case = make_kv_case([(4, 7), (3, 1)], page_size=None)
    case.kv_blocks = case.kv_blocks[:, :, :, :10].clone()
    before = case.kv_blocks.clone()
    with raises_naming(CacheInputError, "sequence 0", "11 tokens", "max_seq_len 10"):
        OP(*case.args())
    assert torch.equal(case.kv_blocks, before)


def test_continuous_slot_out_of_range(make_kv_case):
    case = make_kv_case([(4, 7), (3, 1)], page_size=None)
    case.lookup_table = torch.tensor([0, 3], dtype=torch.int32)
    with raises_naming(CacheInputError, "lookup_table[1] = 3", "slot", "[0, 3)"):
        OP(*case.args())


def test_check_inputs_rejects_devices_and_bad_scale(make_kv_case):
    case = make_kv_case([(4, 7), (3, 1)])
    args = list(case.args())
    with raises_naming(CacheInputError, "scale", "nan"):
        check_inputs(*args, scale=float("nan"))
    args[4] = case.cache_lengths.to("meta")
    with raises_naming(CacheInputError, "cache_lengths is on meta", "kv_blocks is on cpu"):
        check_inputs(*args)
    args[4], args[7] = case.cache_lengths, case.max_lengths.to("meta")
    with raises_naming(CacheInputError, "max_lengths", "CPU", "meta"):

        check_inputs(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "continuous"])
def test_cuda_op_matches_golden(make_kv_case, check_against_golden, page_size):
    case = make_kv_case([(20, 1), (0, 17), (7, 9)], page_size=page_size, device="cuda")
    before = case.kv_blocks.clone()
    ref = reference.ragged_attention(*case.clone().args())
    out = OP(*case.args())
    check_against_golden(out, case.golden(), ref)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))


@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_fake_impl_on_symbolic_graph_inputs_adds_no_guards(strategy):
    """As in a lowered graph: KV placeholders from the manager's symbols, token count symbolic."""
    from kvgraph.cache.params import KVCacheParams
    from kvgraph.cache.symbols import TensorType, fake_inputs, ragged_input_symbols

    params = KVCacheParams(torch.float32, n_kv_heads=2, head_dim=16, num_layers=3, page_size=8,
                           cache_strategy=strategy)
    types = [
        TensorType(torch.float32, ("total_tokens", 4, 16)),
        TensorType(torch.float32, ("total_tokens", 2, 16)),
        TensorType(torch.float32, ("total_tokens", 2, 16)),
        *ragged_input_symbols(params),
        TensorType(torch.int32, ("batch_size_plus_1",)),
    ]
    mode = FakeTensorMode(shape_env=ShapeEnv())
    q, k, v, blocks, cache_lengths, lookup, max_lengths, offsets = fake_inputs(types, mode)
    with mode:
        out = OP(q, k, v, blocks, cache_lengths, lookup, offsets, max_lengths, 2)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not mode.shape_env.guards
