"""The C++ kernel's two ways through a prompt's tiles (KVGRAPH_PREFILL_TILES): every row of an item
at once as two small products (``csrc/prefill_tiles_avx2.h``, the default where it applies) and one
query row at a time. Both against the float64 golden on prompts long enough for several tiles and
pages, with GQA, windows, softcap and the head sizes either path takes; and agreeing with each other."""

from __future__ import annotations

import pytest
import torch

from kvgraph.ops import cpp
from tests.naming import raises_naming

# (cached, new) tokens: several 16-token items per sequence, tiles across pages, a cached prefix
LENGTHS = [(0, 150), (37, 60), (0, 17), (200, 33)]
PATHS = ["auto", "rows"]


@pytest.fixture(autouse=True)
def _needs_the_kernel():
    if not cpp.available():
        pytest.skip("kvgraph's C++ CPU kernel is not built here")


def run(monkeypatch, path, case, **kwargs):
    monkeypatch.setenv("KVGRAPH_PREFILL_TILES", path)
    return cpp.ragged_attention(*case.clone().args(), **kwargs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_dim", [16, 64, 24], ids=["d16", "d64", "d24-rows-only"])
@pytest.mark.parametrize("page_size", [1, 16, 128, None], ids=["page1", "page16", "page128", "continuous"])
def test_prompts_match_golden(monkeypatch, make_kv_case, check_against_golden, path, n_heads, n_kv_heads, head_dim,
                              page_size):
    case = make_kv_case(LENGTHS, page_size=page_size, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
    out = run(monkeypatch, path, case)
    check_against_golden(out, case.golden(), run(monkeypatch, "rows", case))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("option", [{"sliding_window": 1}, {"sliding_window": 21}, {"sliding_window": 70},
                                    {"softcap": 1.0, "scale": 1.0}, {"softcap": 5.0, "sliding_window": 21}],
                         ids=["window1", "window21", "window70", "softcap", "softcap-window"])
def test_windows_and_softcap_match_golden(monkeypatch, make_kv_case, check_against_golden, path, dtype, option):
    case = make_kv_case(LENGTHS, n_heads=8, n_kv_heads=2, head_dim=32, dtype=dtype)
    out = run(monkeypatch, path, case, **option)
    assert out.dtype == dtype
    check_against_golden(out, case.golden(**option), run(monkeypatch, "rows", case, **option))


def test_the_paths_agree_to_float32_rounding(monkeypatch, make_kv_case):
    case = make_kv_case(LENGTHS, n_heads=8, n_kv_heads=4, head_dim=64)
    tiles, rows = run(monkeypatch, "auto", case), run(monkeypatch, "rows", case)
    torch.testing.assert_close(tiles, rows, rtol=1e-5, atol=1e-5)


def test_an_unknown_path_is_refused(monkeypatch, make_kv_case):
    case = make_kv_case([(0, 20)])
    with raises_naming(ValueError, "KVGRAPH_PREFILL_TILES=fast", "auto, rows"):
        run(monkeypatch, "fast", case)
