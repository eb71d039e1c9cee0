import threading

import pytest
import torch

import kvgraph
from kvgraph import (
    BindingError,
    ContinuousBatchingKVCacheManager,
    KVCacheInputsSequence,
    KVCacheParams,
    KVRequest,
    PagedKVCacheManager,
    RaggedKVCacheInputs,
)
from kvgraph.compiler.runtime import (
    KV_PLACEHOLDERS,
    CacheLayout,
    check_fit,
    current_binding,
    intra_op_threads,
    require_binding,
)
from tests.naming import raises_naming

PARAMS = dict(dtype=torch.float32, n_kv_heads=2, head_dim=8, num_layers=3)


def paged_params(**kw):
    return KVCacheParams(**{**PARAMS, "page_size": 4, "cache_strategy": "paged", **kw})


def continuous_params(**kw):
    return KVCacheParams(**{**PARAMS, "page_size": None, "cache_strategy": "continuous", **kw})


def fetched(params, lengths=(3, 5)):
    """One fetch of a batch with ``lengths`` new tokens, and its row offsets."""
    if params.is_paged:
        manager = PagedKVCacheManager(params, max_batch_size=4, max_seq_len=32, num_pages=32)
    else:
        manager = ContinuousBatchingKVCacheManager(params, max_batch_size=4, max_seq_len=32)
    ids = manager.claim(len(lengths))
    kv = manager.fetch([KVRequest(i, list(range(n))) for i, n in zip(ids, lengths, strict=True)])
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return kv, offsets


def test_bind_is_a_stack_popped_on_exit_and_on_error():
    kv, offs = fetched(paged_params())
    assert current_binding() is None
    with kvgraph.bind(kv, offs) as outer:
        assert current_binding() is outer
        with kvgraph.bind(kv[0], offs) as inner:
            assert current_binding() is inner and inner is not outer
        assert current_binding() is outer
        with pytest.raises(RuntimeError, match="boom"), kvgraph.bind(kv, offs):
            raise RuntimeError("boom")
        assert current_binding() is outer
    assert current_binding() is None


def test_bindings_are_private_to_their_thread():
    kv, offs = fetched(paged_params())
    seen = []
    with kvgraph.bind(kv, offs):
        t = threading.Thread(target=lambda: seen.append(current_binding()))
        t.start()
        t.join()
    assert seen == [None]


@pytest.mark.parametrize("wrap", [lambda kv: kv, lambda kv: kv[0], lambda kv: (kv[0],), KVCacheInputsSequence])
def test_bind_accepts_fetch_output_one_input_or_a_sequence_of_one(wrap):
    kv, offs = fetched(paged_params())
    with kvgraph.bind(wrap(kv), offs) as b:
        assert b.kv_inputs is kv[0]


def test_bind_rejects_several_devices_and_other_types_binding_nothing():
    kv, offs = fetched(paged_params())
    with raises_naming(BindingError, "one device", "sequence of 2"):
        with kvgraph.bind([kv[0], kv[0]], offs):
            pass
    with raises_naming(BindingError, "RaggedKVCacheInputs", "dict"):
        with kvgraph.bind({"blocks": kv[0].blocks}, offs):
            pass
    assert current_binding() is None


@pytest.mark.parametrize(
    "offsets, names",
    [
        (torch.tensor([0, 3, 8], dtype=torch.int64), ("input_row_offsets", "torch.int32", "torch.int64")),
        (torch.tensor([0, 8], dtype=torch.int32), ("input_row_offsets", "batch = len(cache_lengths) = 2")),
        (torch.tensor([[0, 3, 8]], dtype=torch.int32), ("input_row_offsets", "(1, 3)")),
        ([0, 3, 8], ("input_row_offsets", "tensor", "list")),
    ],
)
def test_bind_rejects_bad_row_offsets(offsets, names):
    kv, _ = fetched(paged_params())
    with raises_naming(BindingError, *names):
        with kvgraph.bind(kv, offsets):
            pass
    assert current_binding() is None


@pytest.mark.parametrize(
    "positions, names",
    [
        (torch.tensor([2, 7], dtype=torch.int64), ("logit_positions", "torch.int32", "torch.int64")),
        (torch.tensor([], dtype=torch.int32), ("logit_positions", "num_logits >= 1", "(0,)")),
        (torch.tensor([0, 8], dtype=torch.int32), ("logit_positions", "8", "8 tokens")),
        (torch.tensor([-1], dtype=torch.int32), ("logit_positions", "-1")),
        ([2, 7], ("logit_positions", "tensor", "list")),
    ],
)
def test_bind_rejects_bad_logit_positions(positions, names):
    kv, _ = fetched(paged_params())
    with raises_naming(BindingError, *names):
        with kvgraph.bind(kv, torch.tensor([0, 3, 8], dtype=torch.int32), positions):
            pass
    assert current_binding() is None


def test_logit_positions_default_to_each_sequences_last_token():
    kv, _ = fetched(paged_params())
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32)
    with kvgraph.bind(kv, offsets) as binding:
        assert binding.tensors(["logit_positions"])[0].tolist() == [2, 7]
    wanted = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
    with kvgraph.bind(kv, offsets, wanted) as binding:
        assert binding.tensors(["input_row_offsets", "logit_positions"])[1] is wanted


def test_bind_rejects_blocks_and_lookup_of_the_wrong_rank():
    kv, offs = fetched(paged_params())
    flat = RaggedKVCacheInputs(kv[0].blocks.flatten(0, 1), kv[0].cache_lengths, kv[0].lookup_table, kv[0].max_lengths)
    with raises_naming(BindingError, "blocks", "num_layers", "(64, 3, 4, 2, 8)"):
        with kvgraph.bind(flat, offs):
            pass
    cube = RaggedKVCacheInputs(kv[0].blocks, kv[0].cache_lengths, kv[0].lookup_table[..., None], kv[0].max_lengths)
    with raises_naming(BindingError, "lookup_table", "[batch, max_num_pages] (paged)", "[batch] (continuous)", "(2, 2, 1)"):
        with kvgraph.bind(cube, offs):
            pass


def test_require_binding_says_how_to_bind():
    with pytest.raises(BindingError, match=r"kvgraph\.bind\(kv_inputs, input_row_offsets\)"):
        require_binding()


def test_layout_reads_strategy_page_size_and_device_from_the_tensors():
    kv, offs = fetched(paged_params(page_size=4))
    with kvgraph.bind(kv, offs) as b:
        assert b.layout == CacheLayout(kvgraph.KVCacheStrategy.PAGED, 4, torch.device("cpu"))
        assert b.layout == CacheLayout.of(paged_params(page_size=4))
    kv, offs = fetched(continuous_params())
    with kvgraph.bind(kv, offs) as b:
        assert b.layout == CacheLayout(kvgraph.KVCacheStrategy.CONTINUOUS, None, torch.device("cpu"))
        assert str(b.layout) == "continuous on cpu"


def test_tensors_follow_the_placeholder_order():
    kv, offs = fetched(paged_params())
    with kvgraph.bind(kv, offs) as b:
        k = kv[0]
        assert b.tensors() == [k.blocks, k.cache_lengths, k.lookup_table, k.max_lengths, offs]
        assert b.tensors(["input_row_offsets", "kv_blocks"]) == [offs, k.blocks]
    assert KV_PLACEHOLDERS == ("kv_blocks", "cache_lengths", "lookup_table", "max_lengths", "input_row_offsets")


@pytest.mark.parametrize("make", [paged_params, continuous_params])
def test_check_fit_accepts_the_cache_of_its_own_params(make):
    params = make()
    kv, offs = fetched(params)
    with kvgraph.bind(kv, offs) as b:
        check_fit(b, params, torch.device("cpu"))


@pytest.mark.parametrize(
    "graph_kw, needle",
    [
        (dict(num_layers=4), "dim 2 is 3, expected 4"),
        (dict(n_kv_heads=1), "dim 4 is 2, expected 1"),
        (dict(head_dim=16), "dim 5 is 8, expected 16"),
        (dict(dtype=torch.float16), "dtype torch.float32 does not match expected torch.float16"),
        (dict(page_size=8), "paged, page_size=4 on cpu, but the graph was compiled for paged, page_size=8"),
        (dict(page_size=None, cache_strategy="continuous"), "compiled for continuous on cpu"),
    ],
)
def test_check_fit_names_both_sides(graph_kw, needle):
    kv, offs = fetched(paged_params())
    with kvgraph.bind(kv, offs) as b:
        with pytest.raises(BindingError) as err:
            check_fit(b, paged_params(**graph_kw), torch.device("cpu"))
    msg = str(err.value)
    assert needle in msg
    if "dim" in needle or "dtype" in needle:
        assert "the bound blocks are torch.float32 (32, 2, 3, 4, 2, 8)" in msg


def test_check_fit_names_the_model_device():
    kv, offs = fetched(paged_params())
    with kvgraph.bind(kv, offs) as b:
        with raises_naming(BindingError, "paged, page_size=4 on cpu", "(model tensors on meta)"):
            check_fit(b, paged_params(), torch.device("meta"))


def test_check_fit_checks_index_tensors_against_the_graph_types():
    kv, offs = fetched(paged_params())
    k = kv[0]
    short = RaggedKVCacheInputs(k.blocks, k.cache_lengths, k.lookup_table[:1], k.max_lengths)
    with kvgraph.bind(short, offs) as b:
        with raises_naming(BindingError, "lookup_table", "dim 0 (batch_size) is 1", "batch_size is 2"):

            check_fit(b, paged_params())


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_bind_rejects_thread_counts_that_are_not_positive_ints(threads):
    kv, offs = fetched(paged_params())
    with raises_naming(BindingError, "threads", repr(threads)), kvgraph.bind(kv, offs, threads=threads):
        pass
    assert current_binding() is None


def test_intra_op_threads_are_restored_after_the_block_and_on_error():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with intra_op_threads(target):
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"), intra_op_threads(target):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with intra_op_threads(None):
        assert torch.get_num_threads() == before
