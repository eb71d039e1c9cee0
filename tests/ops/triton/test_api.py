"""``ragged_attention``: the op's arguments, the store, dispatch to decode or prefill, and steps
of a generation; on CUDA, a Hugging Face Llama through ``kvgraph.compile`` keeps its greedy tokens."""

import pytest
import torch

import kvgraph.ops.triton.api as api
from kvgraph.ops.triton import ragged_attention
from tests.ops.triton.triton_cases import DEVICE, gpu, reference_output, windowed_golden


@pytest.fixture
def launches(monkeypatch):
    """The attention launchers ``ragged_attention`` calls, in order: ``"decode"`` / ``"prefill"``."""
    calls = []
    for kernel in ("decode", "prefill"):
        launch = getattr(api, f"launch_{kernel}")

        def spy(*args, _launch=launch, _kernel=kernel, **kwargs):
            calls.append(_kernel)
            return _launch(*args, **kwargs)

        monkeypatch.setattr(api, f"launch_{kernel}", spy)
    return calls


def test_every_batch_shape_and_cache_layout(make_kv_case, check_against_golden, ragged_lengths, cache_page_size):
    case = make_kv_case(ragged_lengths, page_size=cache_page_size, device=DEVICE)
    before = case.kv_blocks.clone()
    ref = reference_output(case)
    out = ragged_attention(*case.args())
    check_against_golden(out, case.golden(), ref)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))


@pytest.mark.parametrize(
    "lengths, kernel", [([(5, 1), (0, 1), (9, 0)], "decode"), ([(5, 1), (0, 2)], "prefill")]
)
def test_dispatches_on_max_new_tokens(make_kv_case, check_against_golden, launches, lengths, kernel):
    case = make_kv_case(lengths, device=DEVICE)
    ref = reference_output(case)
    check_against_golden(ragged_attention(*case.args()), case.golden(), ref)
    assert launches == [kernel]


@pytest.mark.parametrize("window", [1, 5, 40])
def test_sliding_window_every_batch_shape(make_kv_case, check_against_golden, ragged_lengths, window):
    case = make_kv_case(ragged_lengths, device=DEVICE)
    before = case.kv_blocks.clone()
    ref = reference_output(case, sliding_window=window)
    out = ragged_attention(*case.args(), sliding_window=window)
    check_against_golden(out, windowed_golden(case, window), ref)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))


@pytest.mark.parametrize("softcap, window", [(1.0, None), (30.0, None), (1.0, 5)])
def test_softcap_every_batch_shape(make_kv_case, check_against_golden, ragged_lengths, softcap, window):
    case = make_kv_case(ragged_lengths, device=DEVICE)
    before = case.kv_blocks.clone()
    ref = reference_output(case, sliding_window=window, softcap=softcap)
    out = ragged_attention(*case.args(), sliding_window=window, softcap=softcap)
    check_against_golden(out, windowed_golden(case, window, softcap=softcap), ref)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))


@pytest.mark.parametrize(
    "lengths, kernel", [([(40, 1), (0, 1), (9, 0)], "decode"), ([(40, 1), (0, 9)], "prefill")]
)
def test_softcap_reaches_both_kernels(make_kv_case, check_against_golden, launches, lengths, kernel):
    # scores around +-11 (scale 2): a cap dropped on the way to a kernel changes its output
    case = make_kv_case(lengths, head_dim=32, device=DEVICE)
    ref = reference_output(case, scale=2.0, softcap=1.0)
    out = ragged_attention(*case.args(), scale=2.0, softcap=1.0)
    check_against_golden(out, windowed_golden(case, None, 2.0, softcap=1.0), ref)
    assert not torch.allclose(out, ragged_attention(*case.args(), scale=2.0), atol=1e-2)
    assert launches == [kernel, kernel]


def test_a_step_without_new_tokens_returns_an_empty_output(make_kv_case):
    case = make_kv_case([(3, 0), (5, 0)], device=DEVICE)
    before = case.kv_blocks.clone()
    out = ragged_attention(*case.args())
    assert out.shape == (0, *case.q.shape[1:]) and out.dtype == case.q.dtype
    assert torch.equal(case.kv_blocks, before)


def test_an_empty_batch_dispatched_to_decode_returns_an_empty_output(make_kv_case, launches):
    # max_lengths of a decode step (a stale row) over a batch of no sequences
    case = make_kv_case([], device=DEVICE)
    case.max_lengths = torch.tensor([[1, 5]], dtype=torch.int32)
    out = ragged_attention(*case.args())
    assert out.shape == (0, *case.q.shape[1:]) and out.dtype == case.q.dtype
    assert launches == ["decode"]


def _step(case, chunks):
    """Op arguments running ``chunks[b] = (start, n)``: tokens ``start .. start + n`` of sequence
    ``b`` of a one-step ``case`` whose sequences all start with an empty cache."""
    offs = case.input_row_offsets.tolist()
    rows = torch.cat([torch.arange(offs[b] + s, offs[b] + s + n) for b, (s, n) in enumerate(chunks)]).to(DEVICE)
    new = [n for _, n in chunks]
    as_int32 = dict(dtype=torch.int32, device=DEVICE)
    return rows, (
        case.q[rows], case.k[rows], case.v[rows], case.kv_blocks,
        torch.tensor([s for s, _ in chunks], **as_int32), case.lookup_table,
        torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), **as_int32),
        torch.tensor([[max(new), max(s + n for s, n in chunks)]], dtype=torch.int32),
        case.layer_idx,
    )


def test_steps_of_a_generation_read_what_earlier_steps_wrote(make_kv_case, check_against_golden, cache_page_size):
    # prefill, decodes, a chunk beside a decode, a step one sequence sits out: each step's output
    # equals the rows of the same tokens attended in one single step
    case = make_kv_case([(0, 14), (0, 9)], page_size=cache_page_size, device=DEVICE)
    before = case.kv_blocks.clone()
    ref, gold = reference_output(case), case.golden()
    schedule = [[(0, 9), (0, 5)], [(9, 1), (5, 1)], [(10, 1), (6, 3)], [(11, 1), (9, 0)], [(12, 2), (9, 0)]]
    for chunks in schedule:
        rows, args = _step(case, chunks)
        check_against_golden(ragged_attention(*args), gold[rows.cpu()], ref[rows])
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))


@pytest.mark.parametrize("window", [1, 3, 7])
def test_steps_of_a_generation_with_a_sliding_window(make_kv_case, check_against_golden, launches, window):
    # the cache keeps every token, each step sees only the window: a step's output equals the rows
    # of the same tokens attended in one single step under the same window
    case = make_kv_case([(0, 14), (0, 9)], device=DEVICE)
    before = case.kv_blocks.clone()
    ref, gold = reference_output(case, sliding_window=window), windowed_golden(case, window)
    schedule = [[(0, 9), (0, 5)], [(9, 1), (5, 1)], [(10, 1), (6, 3)], [(11, 1), (9, 0)], [(12, 2), (9, 0)]]
    for chunks in schedule:
        rows, args = _step(case, chunks)
        check_against_golden(ragged_attention(*args, sliding_window=window), gold[rows.cpu()], ref[rows])
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))
    assert launches == ["prefill", "decode", "prefill", "decode", "prefill"]


@gpu
def test_the_op_on_cuda_runs_these_kernels(make_kv_case, check_against_golden, launches):
    case = make_kv_case([(20, 1), (0, 17), (7, 9)], head_dim=128, device="cuda")
    before = case.kv_blocks.clone()
    ref = reference_output(case, scale=0.2)
    out = torch.ops.kvgraph.ragged_attention(*case.args(), scale=0.2)
    check_against_golden(out, case.golden(0.2), ref)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))
    assert launches == ["prefill"]


@gpu
@pytest.mark.parametrize("window", [1, 16, 100])
def test_the_op_on_cuda_with_a_sliding_window(make_kv_case, check_against_golden, launches, window):
    case = make_kv_case([(200, 1), (0, 170), (77, 90)], head_dim=128, device="cuda")
    before = case.kv_blocks.clone()
    ref = reference_output(case, sliding_window=window)
    out = torch.ops.kvgraph.ragged_attention(*case.args(), sliding_window=window)
    check_against_golden(out, windowed_golden(case, window), ref)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))
    assert launches == ["prefill"]


@gpu
@pytest.mark.parametrize("softcap, window", [(1.0, None), (30.0, None), (50.0, 16)])
def test_the_op_on_cuda_with_a_softcap(make_kv_case, check_against_golden, launches, softcap, window):
    case = make_kv_case([(200, 1), (0, 170), (77, 90)], head_dim=128, device="cuda")
    before = case.kv_blocks.clone()
    ref = reference_output(case, sliding_window=window, softcap=softcap)
    out = torch.ops.kvgraph.ragged_attention(*case.args(), sliding_window=window, softcap=softcap)
    check_against_golden(out, windowed_golden(case, window, softcap=softcap), ref)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))
    assert launches == ["prefill"]


@gpu
@pytest.mark.parametrize("softcap", [1.0, 30.0])
def test_a_decode_step_of_the_op_on_cuda_with_a_softcap(make_kv_case, check_against_golden, launches, softcap):
    case = make_kv_case([(3000, 1), (0, 1), (517, 1)], head_dim=128, device="cuda")
    ref = reference_output(case, scale=0.5, softcap=softcap)
    out = torch.ops.kvgraph.ragged_attention(*case.args(), scale=0.5, softcap=softcap)
    check_against_golden(out, windowed_golden(case, None, 0.5, softcap), ref)
    assert launches == ["decode"]


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("strategy, page_size", [("paged", 16), ("paged", 1), ("continuous", 16)])
def test_llama_greedy_tokens_on_cuda_match_hf_generate(launches, strategy, page_size):
    import kvgraph
    from kvgraph.cache.managers import load_kv_manager
    from kvgraph.cache.params import KVCacheParams
    from kvgraph.cache.request import KVRequest
    from kvgraph.compiler.step import run_step
    from kvgraph.presets import load_preset

    model, _ = load_preset("llama-small")
    model = model.to("cuda").eval()
    c = model.config
    params = KVCacheParams(torch.float32, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                           c.num_hidden_layers, page_size=page_size, cache_strategy=strategy, device="cuda")
    manager = load_kv_manager(params, max_batch_size=4, max_seq_len=128)
    compiled = kvgraph.compile(model, manager=manager, inner="eager")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (17, 5, 33)]
    steps = 12
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=steps, min_new_tokens=steps,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
        seq_ids = manager.claim(len(prompts))
        generated = [[] for _ in prompts]
        batch = [KVRequest(s, p) for s, p in zip(seq_ids, prompts, strict=True)]
        for _ in range(steps):
            out = run_step(compiled, manager, batch)
            logits = out if isinstance(out, torch.Tensor) else out.logits
            for b, token in enumerate(logits[0].argmax(-1).tolist()):
                generated[b].append(token)
            batch = [KVRequest(s, [gen[-1]]) for s, gen in zip(seq_ids, generated, strict=True)]
    assert generated == expected
    assert {"prefill", "decode"} <= set(launches)
