import torch

from kvgraph.engine import LLM, SamplingParams
from kvgraph.engine.runner import ModelRunner
from kvgraph.inputs import RaggedKVCacheInputs


def _meta_step(tokens: int, batch: int):
    """KV inputs, ids, positions and row offsets of a step on the meta device: shapes only, so any
    read of a value (a host sync) raises."""
    meta = dict(device="meta", dtype=torch.int32)
    kv = RaggedKVCacheInputs(
        torch.empty(8, 2, 1, 4, 1, 2, device="meta"), torch.empty(batch, **meta),
        torch.empty(batch, 2, **meta), torch.tensor([[tokens, tokens]], dtype=torch.int32),
    )
    ids = torch.empty(1, tokens, dtype=torch.long, device="meta")
    return [kv], ids, ids, torch.empty(batch + 1, **meta)


def test_runner_records_call_shapes_from_shapes_alone_and_only_inside_the_block():
    runner = ModelRunner(lambda input_ids, position_ids: torch.empty(1, 3, 10, device="meta"))
    runner(*_meta_step(5, 3))
    with runner.record_shapes() as shapes:
        runner(*_meta_step(7, 3))
        runner(*_meta_step(3, 3))
    runner(*_meta_step(3, 3))
    assert shapes == [(7, 3), (3, 3)]
    with runner.record_shapes() as again:
        pass
    assert again == [] and shapes == [(7, 3), (3, 3)]


def test_engine_records_one_shape_per_model_call(llama):
    model, _ = llama
    llm = LLM(model, max_batch_size=4, max_seq_len=64, compile="eager")
    with llm.runner.record_shapes() as shapes:
        llm.generate([[5] * 30, [6] * 9, [7] * 3], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert shapes == [(42, 3), (3, 3), (3, 3)]
