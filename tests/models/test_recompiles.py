"""After warm-up, steps of any batch size and token count run without recompiling."""

import pytest
import torch
from torch._dynamo.utils import counters

import kvgraph
from kvgraph import KVRequest
from kvgraph.compiler.step import run_step
from tests.models.tiny_models import kv_params, make_manager, tiny_llama


def compile_counts() -> dict[str, int]:
    return {
        "dynamo graphs": counters["stats"]["unique_graphs"],
        "kvgraph graphs": counters["kvgraph"]["graphs"],
        "lowerings": counters["kvgraph"]["lowerings"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_no_recompiles_after_warm_up(strategy):
    model = tiny_llama()
    manager = make_manager(kv_params(model, strategy, page_size=4), max_batch_size=6, max_seq_len=64)
    compiled = kvgraph.compile(model, manager=manager, inner="eager")
    g = torch.Generator().manual_seed(0)
    live: dict[int, int] = {}  # seq_id -> tokens cached

    def step(prefills: list[int], decodes: list[int]) -> None:
        """One ragged step: new sequences with prompts of the given lengths, one token for the others."""
        seqs = manager.claim(len(prefills))
        batch = [KVRequest(s, torch.randint(0, 128, (n,), generator=g).tolist()) for s, n in zip(seqs, prefills,
                                                                                             strict=True)]
        batch += [KVRequest(s, [int(torch.randint(0, 128, (1,), generator=g))]) for s in decodes]
        with torch.no_grad():
            logits = run_step(compiled, manager, batch).logits
        assert logits.shape == (1, len(batch), 128)
        for req in batch:
            live[req.seq_id] = live.get(req.seq_id, 0) + len(req.tokens)

    def release(n: int) -> None:
        for s in list(live)[:n]:
            manager.release(s)
            del live[s]

    counters.clear()
    # Warm-up: a prefill (T > 1), then a single-sequence decode (T == 1, Dynamo's own graph).
    step([5, 3], [])
    release(1)
    step([], list(live))
    warm = compile_counts()
    assert warm["lowerings"] == warm["kvgraph graphs"] == warm["dynamo graphs"] == 2

    with torch._dynamo.config.patch(error_on_recompile=True):
        step([], list(live))                # batch 1, T = 1
        step([7, 2, 9], list(live))         # batch 4, mixed prefill and decode
        step([], list(live))                # batch 4, T = 4
        release(3)
        step([1], list(live))               # batch 2, T = 2
        step([4, 4, 4, 4], list(live))      # batch 6, T = 17
        step([], list(live))                # batch 6, T = 6
        release(5)
        step([], list(live))                # batch 1, T = 1 again
        step([30], list(live))              # batch 2, long prompt
    assert compile_counts() == warm
