"""Eight threads claim, fetch, write, step and release on one manager at the same time."""

import random
import sys
import threading

import pytest

from kvgraph import KVRequest, NoFreeSlotsError, OutOfPagesError, PagedKVCacheManager
from tests.cache.kv_checks import KINDS, check_contents, check_invariants, make_manager, write_steps

THREADS = 8
SEQUENCES_PER_THREAD = 20
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 3, 2, 1])


def _run_sequence(m, rng: random.Random) -> bool:
    """One sequence's life; False if there was no slot. Checks its cache before releasing."""
    try:
        (seq_id,) = m.claim(1)
    except NoFreeSlotsError:
        return False
    history: list[int] = []
    try:
        tokens = rng.choice(PREFIXES)[: rng.randint(1, 8)] + [rng.randint(0, 9) for _ in range(rng.randint(0, 3))]
        for _ in range(rng.randint(1, 4)):
            num_steps = rng.randint(1, 2)
            req = KVRequest(seq_id, tokens)
            (x,) = m.fetch([req], num_steps)
            extra = [rng.randint(0, 9) for _ in range(num_steps - 1)]
            full = history + list(tokens) + extra
            write_steps(m, x, [full], [len(history) + req.cached_tokens], [len(req.new_tokens)], num_steps)
            req.tokens = list(tokens) + extra
            m.step([req])
            history = full
            check_contents(m, {seq_id: history})
            tokens = [rng.randint(0, 9)]
    except OutOfPagesError:
        pass
    finally:
        m.release(seq_id)
    return True


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_lifecycles_keep_the_books(kind):
    m = make_manager(kind, max_batch_size=6, max_seq_len=24, num_pages=24)
    errors: list[BaseException] = []
    done = [0] * THREADS

    def worker(t: int) -> None:
        rng = random.Random(t)
        try:
            while done[t] < SEQUENCES_PER_THREAD:
                done[t] += _run_sequence(m, rng)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, inside the managers' methods too
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(th.is_alive() for th in threads), "a worker thread hung"
    assert not errors, errors
    assert done == [SEQUENCES_PER_THREAD] * THREADS
    check_invariants(m)
    assert m.slots_remaining == set(range(m.max_batch_size))
    if isinstance(m, PagedKVCacheManager):
        assert m.free_pages == m.total_pages
