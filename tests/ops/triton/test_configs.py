"""The autotuning spaces and their pruning filters."""

import pytest
import torch

import kvgraph.ops.triton.configs as configs


@pytest.fixture
def cuda_spaces(monkeypatch):
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    return configs.prefill_configs(), configs.decode_configs()


def _args(dtype, head_dim_pad, group_pad=None):
    args = {"Q": torch.empty(0, dtype=dtype), "HEAD_DIM_PAD": head_dim_pad}
    return args if group_pad is None else {**args, "GROUP_PAD": group_pad}


def _rows(c, group_pad):
    return c.kwargs["BLOCK_Q"] * group_pad


def test_interpreter_has_one_small_config_per_kernel(monkeypatch):
    monkeypatch.setattr(configs, "interpreting", lambda: True)
    assert [c.kwargs for c in configs.prefill_configs()] == [{"BLOCK_Q": 16, "BLOCK_N": 16}]
    assert [c.kwargs for c in configs.decode_configs()] == [{"BLOCK_N": 16}]


@pytest.mark.parametrize("group_pad", [1, 2, 4, 8, 16, 64])
@pytest.mark.parametrize("head_dim_pad", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_tiles_have_64_to_128_rows_that_fit(cuda_spaces, group_pad, head_dim_pad, dtype):
    kept = configs.prune_prefill(cuda_spaces[0], _args(dtype, head_dim_pad, group_pad))
    assert kept
    for c in kept:
        rows, bn = _rows(c, group_pad), c.kwargs["BLOCK_N"]
        assert configs.MIN_ROWS <= rows <= configs.MAX_ROWS
        assert max(rows, bn) * head_dim_pad * 2 <= configs.TILE_BYTES
        assert c.num_warps == 4 or rows * bn >= 128 * 64


def test_fp32_with_the_largest_heads_takes_smaller_tiles(cuda_spaces):
    kept = configs.prune_prefill(cuda_spaces[0], _args(torch.float32, 256, 2))
    assert kept
    assert {_rows(c, 2) for c in kept} == {16, 32}
    assert {c.kwargs["BLOCK_N"] for c in kept} == {32}


@pytest.mark.parametrize("group_pad, head_dim_pad", [(256, 128), (128, 256)])
def test_more_query_heads_than_a_tile_take_one_token_per_tile(cuda_spaces, group_pad, head_dim_pad):
    kept = configs.prune_prefill(cuda_spaces[0], _args(torch.float16, head_dim_pad, group_pad))
    assert [(c.kwargs["BLOCK_Q"], c.kwargs["BLOCK_N"]) for c in kept] == [(1, 32)]


def test_decode_drops_the_biggest_tiles_for_the_biggest_heads(cuda_spaces):
    kept = configs.prune_decode(cuda_spaces[1], _args(torch.bfloat16, 256))
    assert {c.kwargs["BLOCK_N"] for c in kept} == {32, 64}


@pytest.mark.parametrize("head_dim_pad", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_key_tiles_fit(cuda_spaces, head_dim_pad, dtype):
    kept = configs.prune_decode(cuda_spaces[1], _args(dtype, head_dim_pad))
    assert kept
    element = torch.empty(0, dtype=dtype).element_size()
    assert all(c.kwargs["BLOCK_N"] * head_dim_pad * element <= configs.TILE_BYTES for c in kept)


def test_autotuning_can_be_switched_off_to_the_first_kept_config(cuda_spaces, monkeypatch):
    args = _args(torch.float16, 128, 4)
    kept = configs.prune_prefill(cuda_spaces[0], args)
    early_prune = configs.autotuned(configs.prune_prefill)
    monkeypatch.setenv(configs.AUTOTUNE_ENV, "1")
    assert early_prune(cuda_spaces[0], args) == kept and len(kept) > 1
    monkeypatch.setenv(configs.AUTOTUNE_ENV, "0")
    assert early_prune(cuda_spaces[0], args) == kept[:1]
