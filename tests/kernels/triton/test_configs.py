"""The autotuning spaces and their pruning filters."""

import kvgraph.kernels.triton.configs as configs
import pytest


@pytest.fixture
def cuda_spaces(monkeypatch):
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    return configs.prefill_configs(), configs.decode_configs()


def test_interpreter_has_one_small_config_per_kernel():
    assert [c.kwargs for c in configs.prefill_configs()] == [{"BLOCK_Q": 16, "BLOCK_N": 16}]
    assert [c.kwargs for c in configs.decode_configs()] == [{"BLOCK_N": 16}]


@pytest.mark.parametrize("group_pad", [1, 2, 4, 8, 16, 64, 128])
@pytest.mark.parametrize("head_dim_pad", [16, 64, 128, 256])
def test_prefill_tiles_have_64_to_128_rows_that_fit(cuda_spaces, group_pad, head_dim_pad):
    if group_pad * head_dim_pad > configs.TILE_ELEMENTS:
        pytest.skip("one token of every query head of a KV head is already more than a tile")
    kept = configs.prune_prefill(cuda_spaces[0], {"GROUP_PAD": group_pad, "HEAD_DIM_PAD": head_dim_pad})
    assert kept
    for c in kept:
        rows = c.kwargs["BLOCK_Q"] * group_pad
        assert 64 <= rows <= configs.MAX_ROWS
        assert rows * head_dim_pad <= configs.TILE_ELEMENTS
        assert c.kwargs["BLOCK_N"] * head_dim_pad <= configs.TILE_ELEMENTS
        assert c.num_warps == 4 or rows * c.kwargs["BLOCK_N"] >= 128 * 64


@pytest.mark.parametrize("group_pad, head_dim_pad", [(256, 128), (128, 256)])
def test_prefill_with_more_query_heads_than_a_tile_takes_one_token_per_tile(cuda_spaces, group_pad, head_dim_pad):
    kept = configs.prune_prefill(cuda_spaces[0], {"GROUP_PAD": group_pad, "HEAD_DIM_PAD": head_dim_pad})
    assert [(c.kwargs["BLOCK_Q"], c.kwargs["BLOCK_N"]) for c in kept] == [(1, 32)]


def test_decode_drops_the_biggest_tiles_for_the_biggest_heads(cuda_spaces):
    kept = configs.prune_decode(cuda_spaces[1], {"HEAD_DIM_PAD": 256})
    assert {c.kwargs["BLOCK_N"] for c in kept} == {32, 64}


@pytest.mark.parametrize("head_dim_pad", [16, 64, 128, 256])
def test_decode_key_tiles_fit(cuda_spaces, head_dim_pad):
    kept = configs.prune_decode(cuda_spaces[1], {"HEAD_DIM_PAD": head_dim_pad})
    assert kept
    assert all(c.kwargs["BLOCK_N"] * head_dim_pad <= configs.TILE_ELEMENTS for c in kept)
