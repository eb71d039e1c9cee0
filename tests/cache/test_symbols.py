import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from kvgraph import (
    CacheInputError,
    KVCacheParams,
    PaddedKVCacheInputSymbols,
    RaggedKVCacheInputSymbols,
    TensorType,
)
from kvgraph.cache.symbols import fake_inputs, ragged_input_symbols
from tests.naming import raises_naming


def paged_params(**kw):
    return KVCacheParams(torch.float16, n_kv_heads=2, head_dim=64, num_layers=3, page_size=16, **kw)


def test_paged_symbols_follow_the_max_layout():
    syms = ragged_input_symbols(paged_params())
    assert isinstance(syms, RaggedKVCacheInputSymbols)
    assert syms.names() == ("kv_blocks", "cache_lengths", "lookup_table", "max_lengths")
    assert syms.kv_blocks.shape == ("total_num_pages", 2, 3, 16, 2, 64)
    assert syms.lookup_table.shape == ("batch_size", "max_num_pages")
    assert syms.cache_lengths.dtype == torch.int32
    assert syms.max_lengths.device == torch.device("cpu")
    assert str(syms.kv_blocks) == "f16[total_num_pages, 2, 3, 16, 2, 64] cpu"


def test_continuous_symbols_have_a_slot_lookup():
    params = KVCacheParams(torch.float32, 2, 8, 1, page_size=None, cache_strategy="continuous")
    syms = ragged_input_symbols(params)
    assert syms.kv_blocks.shape == ("max_batch_size", 2, 1, "max_seq_len", 2, 8)
    assert syms.lookup_table.shape == ("batch_size",)


def test_symbols_iterate_and_index_like_max():
    syms = ragged_input_symbols(paged_params())
    assert len(syms) == 4
    assert list(syms) == [syms.kv_blocks, syms.cache_lengths, syms.lookup_table, syms.max_lengths]
    assert syms[2] is syms.lookup_table
    t = TensorType(torch.float32, (4,))
    padded = PaddedKVCacheInputSymbols(t, t, t, t)
    assert len(list(padded)) == 4


def test_fake_inputs_share_one_symbol_per_name():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    blocks, lengths, lookup, max_lengths = fake_inputs(list(ragged_input_symbols(paged_params())), mode)
    assert all(isinstance(t, FakeTensor) for t in (blocks, lengths, lookup, max_lengths))
    assert isinstance(blocks.shape[0], torch.SymInt)
    assert tuple(blocks.shape[1:]) == (2, 3, 16, 2, 64)
    assert blocks.dtype == torch.float16
    # batch_size is one symbol in cache_lengths and lookup_table
    assert lengths.shape[0].node.expr == lookup.shape[0].node.expr
    assert lookup.shape[1].node.expr != lookup.shape[0].node.expr
    assert max_lengths.shape[1] == 2


def test_fake_inputs_need_a_shape_env():
    with pytest.raises(CacheInputError, match="ShapeEnv"):
        fake_inputs([TensorType(torch.float32, ("batch_size",))], FakeTensorMode())


def test_check_accepts_a_fitting_tensor_and_binds_names():
    syms = ragged_input_symbols(paged_params())
    bound: dict[str, int] = {}
    syms.cache_lengths.check(torch.zeros(3, dtype=torch.int32), "cache_lengths", bound)
    assert bound == {"batch_size": 3}
    with raises_naming(CacheInputError, "lookup_table", "dim 0 (batch_size) is 4", "batch_size is 3"):
        syms.lookup_table.check(torch.zeros(4, 2, dtype=torch.int32), "lookup_table", bound)


@pytest.mark.parametrize(
    "tensor, names",
    [
        (torch.zeros(5, 2, 3, 16, 2, 64, dtype=torch.float32), ("kv_blocks", "dtype torch.float32", "torch.float16")),
        (torch.zeros(5, 2, 3, 16, 2, dtype=torch.float16), ("kv_blocks", "rank 5")),
        (torch.zeros(5, 2, 3, 8, 2, 64, dtype=torch.float16), ("kv_blocks", "dim 3 is 8", "16")),
    ],
)
def test_check_names_the_mismatch(tensor, names):
    with raises_naming(CacheInputError, *names):
        ragged_input_symbols(paged_params()).kv_blocks.check(tensor, "kv_blocks")


def test_tensor_type_rejects_bad_dims():
    with raises_naming(CacheInputError, "shape entries", "non-negative", "-1"):

        TensorType(torch.float32, (-1, 2))
