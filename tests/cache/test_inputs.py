import torch

from kvgraph import KVCacheInputsSequence, KVRequest, PaddedKVCacheInputs, RaggedKVCacheInputs


def ragged(batch=2, paged=True):
    lookup = torch.zeros(batch, 3, dtype=torch.int32) if paged else torch.arange(batch, dtype=torch.int32)
    return RaggedKVCacheInputs(
        blocks=torch.zeros(4, 2, 1, 16, 1, 8),
        cache_lengths=torch.zeros(batch, dtype=torch.int32),
        lookup_table=lookup,
        max_lengths=torch.tensor([[5, 5]], dtype=torch.int32),
    )


def test_ragged_inputs_flatten_in_max_order():
    inputs = ragged()
    assert [t for t in inputs] == [inputs.blocks, inputs.cache_lengths, inputs.lookup_table, inputs.max_lengths]
    assert len(inputs) == 4
    assert inputs[3] is inputs.max_lengths
    assert inputs.is_paged and inputs.batch_size == 2
    assert not ragged(paged=False).is_paged


def test_sequence_flattens_every_member():
    a, b = ragged(), ragged(batch=3)
    seq = KVCacheInputsSequence([a, b])
    assert len(seq) == 8
    assert list(seq)[4] is b.blocks


def test_padded_inputs_iterate():
    t = [torch.zeros(1) for _ in range(4)]
    assert list(PaddedKVCacheInputs(*t)) == t


def test_request_new_tokens_skip_the_cached_prefix():
    req = KVRequest(seq_id=7, tokens=[1, 2, 3, 4, 5])
    assert list(req.new_tokens) == [1, 2, 3, 4, 5]
    req.cached_tokens = 4
    assert list(req.new_tokens) == [5]
    assert req.prompt is None


def test_repr_shows_shapes_not_values():
    x = RaggedKVCacheInputs(
        torch.zeros(8, 2, 2, 4, 2, 4), torch.zeros(3, dtype=torch.int32),
        torch.zeros(3, 2, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
    )
    assert repr(x) == (
        "RaggedKVCacheInputs(blocks=float32[8, 2, 2, 4, 2, 4] cpu, cache_lengths=int32[3] cpu, "
        "lookup_table=int32[3, 2] cpu, max_lengths=int32[1, 2] cpu)"
    )
