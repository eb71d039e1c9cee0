import pytest
import torch

from kvgraph import BatchSizeError
from kvgraph.compiler.step import StepInputs, prepare_step
from tests.naming import raises_naming


def test_prepare_step_flattens_tokens_positions_and_offsets():
    out = prepare_step([[5, 6, 7], [9], [1, 2]], [0, 4, 10])
    assert isinstance(out, StepInputs)
    assert out.input_ids.tolist() == [[5, 6, 7, 9, 1, 2]]
    assert out.position_ids.tolist() == [[0, 1, 2, 4, 10, 11]]
    assert out.input_row_offsets.tolist() == [0, 3, 4, 6]
    assert out.input_ids.dtype == out.position_ids.dtype == torch.int64
    assert out.input_row_offsets.dtype == torch.int32


def test_prepare_step_takes_cache_lengths_from_a_fetch_tensor():
    ids, pos, offs = prepare_step([[3], [4]], torch.tensor([7, 2], dtype=torch.int32))
    assert pos.tolist() == [[7, 2]]
    assert ids.device == pos.device == offs.device == torch.device("cpu")


def test_prepare_step_one_token():
    ids, pos, offs = prepare_step([[42]], [0])
    assert ids.shape == pos.shape == (1, 1)
    assert offs.tolist() == [0, 1]


@pytest.mark.parametrize(
    "tokens, lengths, names",
    [
        ([], [], ("empty batch",)),
        ([[1], []], [0, 0], ("sequence 1", "no new tokens")),
        ([[1], [2]], [0], ("cache_lengths", "1 entries", "2 sequences")),
    ],
)
def test_prepare_step_rejects_bad_batches(tokens, lengths, names):
    with raises_naming(BatchSizeError, *names):

        prepare_step(tokens, lengths)
