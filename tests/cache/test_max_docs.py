"""The calls documented on the MAX KV cache pages (``shared/max-docs``), run as written.

Each test names the page it follows. PyTorch adaptations: torch dtypes and devices, int32
for uint32, ``TensorType`` from ``kvgraph``, vectorised ``load``/``store``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import kvgraph
from kvgraph import (
    ContinuousBatchingKVCacheCollection,
    ContinuousBatchingKVCacheManager,
    KVCacheError,
    KVCacheInputs,
    KVCacheInputsSequence,
    KVCacheInputSymbols,
    KVCacheManager,
    KVCacheParams,
    KVCacheStrategy,
    KVRequest,
    PaddedKVCacheInputs,
    PagedKVCacheCollection,
    PagedKVCacheManager,
    TensorType,
)
from tests.naming import raises_naming

L, H, D = 2, 2, 4
MAX_BATCH, MAX_SEQ = 4, 32


def params(strategy: str = "paged", **kw) -> KVCacheParams:
    page_size = None if strategy == "continuous" else 4
    return KVCacheParams(
        dtype=torch.float32, n_kv_heads=H, head_dim=D, num_layers=L, page_size=page_size,
        cache_strategy=strategy, **kw,
    )


def managers() -> list[KVCacheManager]:
    """Both managers built with MAX's positional arguments:
    ``(params, max_batch_size, max_seq_len, num_layers, devices, session[, cache_memory])``."""
    cpu = [torch.device("cpu")]
    paged = params()
    return [
        ContinuousBatchingKVCacheManager(params("continuous"), MAX_BATCH, MAX_SEQ, L, cpu, None),
        PagedKVCacheManager(paged, MAX_BATCH, MAX_SEQ, L, cpu, None, 32 * paged.page_bytes),
    ]


# -- 003: max.nn.kv_cache.manager --


def test_input_symbols_subclass_example_as_written():
    """The page's own example: a ``@dataclass`` subclass of ``KVCacheInputSymbols``."""

    @dataclass
    class ContinuousBatchingKVCacheInputSymbols(KVCacheInputSymbols):
        kv_blocks: TensorType
        cache_lengths: TensorType
        lookup_table: TensorType
        max_lengths: TensorType

    t = TensorType(torch.int32, ("batch_size",))
    symbols = ContinuousBatchingKVCacheInputSymbols(
        TensorType(torch.float32, ("max_batch_size", 2, L, "max_seq_len", H, D)), t, t,
        TensorType(torch.int32, ("steps_remaining", 2)),
    )
    assert len(symbols) == 4 and symbols[1] is t and list(symbols)[3].shape == ("steps_remaining", 2)
    symbols.lookup_table = TensorType(torch.int32, ("batch_size", "max_num_pages"))  # not frozen
    assert symbols.lookup_table.rank == 2


def test_kv_cache_inputs_subclass_example_as_written():
    @dataclass
    class RaggedKVCacheInputs(KVCacheInputs):
        blocks: Tensor
        cache_lengths: Tensor
        lookup_table: Tensor
        max_lengths: Tensor

    tensors = [torch.zeros(3), torch.ones(2), torch.zeros(2), torch.ones(1, 2)]
    inputs = RaggedKVCacheInputs(*tensors)
    assert len(inputs) == 4 and all(a is b for a, b in zip(inputs, tensors, strict=True))
    seq = KVCacheInputsSequence(kv_cache_inputs=[inputs, inputs])
    assert len(seq) == 8


def test_padded_and_ragged_inputs_take_the_documented_parameters():
    t = torch.zeros(1)
    padded = PaddedKVCacheInputs(k_cache=t, v_cache=t, start_pos=t, null_op=t)
    assert list(padded) == [t, t, t, t]
    ragged = kvgraph.RaggedKVCacheInputs(blocks=t, cache_lengths=t, lookup_table=t, max_lengths=t)
    assert (ragged.blocks, ragged.cache_lengths, ragged.lookup_table, ragged.max_lengths) == (t, t, t, t)


@pytest.mark.parametrize("index", [0, 1], ids=["continuous", "paged"])
def test_manager_lifecycle_as_documented(index):
    """claim -> fetch -> step -> (fetch -> step)* -> release, with every documented query."""
    m = managers()[index]
    assert m.slots_remaining == {0, 1, 2, 3}
    seq_ids = m.claim(2)
    assert isinstance(seq_ids, list) and set(seq_ids) <= set(range(MAX_BATCH))
    assert m.slots_remaining == {0, 1, 2, 3} - set(seq_ids)
    assert all(m.contains(s) for s in seq_ids) and not m.contains(3)
    m.external_claim([3])
    assert m.contains(3) and m.slots_remaining == {2}

    batch = [KVRequest(seq_ids[0], [1, 2, 3, 4, 5]), KVRequest(seq_ids[1], [6, 7]), KVRequest(3, [8])]
    kv_inputs = m.fetch(batch, num_steps=1)
    assert isinstance(kv_inputs, list) and isinstance(kv_inputs[0], KVCacheInputs)
    assert kv_inputs[0].cache_lengths.tolist() == [0, 0, 0]
    m.step(batch)
    decode = [KVRequest(s, [9]) for s in (*seq_ids, 3)]
    (x,) = m.fetch(decode, 2)
    assert x.cache_lengths.tolist() == [5, 2, 1]

    @dataclass
    class ModelInputs:
        input_row_offsets: Tensor

    prev = ModelInputs(input_row_offsets=torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    (y,) = m.increment_cache_lengths(kv_cache_inputs=[x], prev_model_inputs=prev)
    assert y.cache_lengths.tolist() == [6, 3, 2] and y.max_lengths.shape[0] == 1
    assert m.cache_length(seq_ids[0]) == 5  # the manager's own lengths are untouched
    for r in decode:
        r.tokens = [9, 10]
    m.step(decode)
    assert m.cache_length(seq_ids[0]) == 7

    symbols = m.input_symbols()
    assert isinstance(symbols[0], KVCacheInputSymbols) and m.num_kv_inputs() == 4
    for s in (*seq_ids, 3):
        m.release(s)
    assert m.slots_remaining == {0, 1, 2, 3}


@pytest.mark.parametrize("cls", [ContinuousBatchingKVCacheManager, PagedKVCacheManager])
def test_sizing_classmethods_positional_and_keyword(cls):
    p = params("continuous" if cls is ContinuousBatchingKVCacheManager else "paged")
    devices = [torch.device("cpu")]
    memory = 1 << 20
    positional = cls.estimated_memory_size(p, MAX_BATCH, MAX_SEQ, L, memory, devices)
    keyword = cls.estimated_memory_size(
        params=p, max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ, num_layers=L,
        available_cache_memory=memory, devices=devices,
    )
    assert positional == keyword == MAX_BATCH * MAX_SEQ * p.bytes_per_token > 0
    batch = cls.infer_optimal_batch_size(p, MAX_SEQ, L, memory, devices)
    assert batch == cls.infer_optimal_batch_size(
        params=p, max_seq_len=MAX_SEQ, num_layers=L, available_cache_memory=memory, devices=devices
    ) == memory // (MAX_SEQ * p.bytes_per_token)
    with raises_naming(KVCacheError, "num_layers=3", "params.num_layers=2"):
        cls.infer_optimal_batch_size(p, MAX_SEQ, 3, memory, devices)


def test_sizing_splits_memory_over_devices():
    p = params(n_devices=2)
    assert p.n_kv_heads_per_device == 1
    two = [torch.device("cpu"), torch.device("cpu")]
    per_seq = MAX_SEQ // p.page_size * p.page_bytes
    assert PagedKVCacheManager.infer_optimal_batch_size(p, MAX_SEQ, L, 3 * per_seq, two) == 3
    m = PagedKVCacheManager(p, MAX_BATCH, MAX_SEQ, L, two, None, 10 * p.page_bytes)
    assert m.total_pages == 10 and len(m.device_blocks) == 2
    assert m.blocks.shape == (10, 2, L, 4, 1, D)
    (s,) = m.claim(1)
    inputs = m.fetch([KVRequest(s, [1, 2, 3])])
    assert len(inputs) == 2 and inputs[1].blocks is m.device_blocks[1]
    assert len(m.input_symbols()) == 2 and m.input_symbols()[0].kv_blocks.shape[4] == 1


# -- 000 / 002: collections and per-layer caches --


def test_collections_take_max_constructor_arguments():
    m = managers()[0]
    (s,) = m.claim(1)
    (x,) = m.fetch([KVRequest(s, [1, 2, 3])])
    c = ContinuousBatchingKVCacheCollection(x.blocks, x.cache_lengths, x.lookup_table, 3, 3)
    k = c.get_key_cache(0)
    assert (k.max_seq_length, k.max_cache_length) == (c.max_seq_length, c.max_cache_length) == (3, 3)
    assert c.cache_length(0) == 0 and k.empty_cache()
    assert (k.max_prompt_length(), k.max_context_length()) == (3, 3)
    k.store(torch.tensor([0]), torch.tensor([1]), torch.full((1, H, D), 7.0))
    assert torch.equal(c.get_key_cache(0).load(torch.tensor([0]), torch.tensor([1])), torch.full((1, H, D), 7.0))
    assert int(k.row_idx(0, 1)) == s * MAX_SEQ + 1 and int(k.col_idx(1)) == D

    p = managers()[1]
    (s,) = p.claim(1)
    (x,) = p.fetch([KVRequest(s, [1, 2, 3, 4, 5])])
    pc = PagedKVCacheCollection(x.blocks, x.cache_lengths, x.lookup_table, 5, 5)
    assert pc.get_value_cache(1).page_size == 4 and pc.cache_length(0) == 0


# -- KVCacheParams, strategies, errors --


def test_params_n_devices_and_model_default():
    p = KVCacheParams(dtype=torch.bfloat16, n_kv_heads=8, head_dim=64, num_layers=2, n_devices=4,
                      cache_strategy=KVCacheStrategy.MODEL_DEFAULT)
    assert p.n_devices == 4 and p.n_kv_heads_per_device == 2
    assert p.cache_strategy is KVCacheStrategy.PAGED
    with raises_naming(KVCacheError, "n_kv_heads=8", "n_devices=3"):
        KVCacheParams(dtype=torch.float32, n_kv_heads=8, head_dim=64, num_layers=2, n_devices=3)


def test_constructor_checks_num_layers_and_devices():
    p = params()
    with raises_naming(KVCacheError, "num_layers=5", "params.num_layers=2"):
        PagedKVCacheManager(p, MAX_BATCH, MAX_SEQ, 5, [torch.device("cpu")], None, 1 << 16)
    with raises_naming(KVCacheError, "devices", "2 device(s)", "params.n_devices=1"):
        PagedKVCacheManager(p, MAX_BATCH, MAX_SEQ, L, ["cpu", "cpu"], None, 1 << 16)
    with raises_naming(KVCacheError, "params.n_devices=2", "devices", "2 devices"):
        PagedKVCacheManager(params(n_devices=2), MAX_BATCH, MAX_SEQ, num_pages=4)


@pytest.mark.parametrize("index", [0, 1], ids=["continuous", "paged"])
def test_fetch_of_a_bare_seq_id_names_the_expected_type(index):
    m = managers()[index]
    m.claim(1)
    with raises_naming(kvgraph.BatchTypeError, "batch[0]", "int 1", "KVRequest"):
        m.fetch([1])
    with raises_naming(TypeError, "batch", "list", "KVRequest"):

        m.step(KVRequest(0, [1]))


def test_model_default_strategy_reads_as_paged_from_a_model_config():
    from kvgraph.engine.loading import kv_params_from_config
    from kvgraph.presets import load_preset

    model, _ = load_preset("llama-tiny")
    p = kv_params_from_config(
        model, cache_strategy="model_default", page_size=8, enable_prefix_caching=True, device=torch.device("cpu")
    )
    assert p.cache_strategy is KVCacheStrategy.PAGED and p.page_size == 8 and p.enable_prefix_caching
