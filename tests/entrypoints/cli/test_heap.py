"""The command's garbage collector at start-up: survivors of full collections frozen, then the warm heap."""

import subprocess
import sys
import textwrap


def run_python(body: str) -> str:
    script = "import gc\nfrom kvgraph.entrypoints.cli import heap\n" + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_start_up_survivors_are_frozen_until_the_heap_is_warm_then_collections_run_as_usual():
    out = run_python("""
        heap.freeze_startup_survivors()
        kept = [[i] for i in range(10000)]
        before = gc.get_freeze_count()
        gc.collect()  # a full collection: what it leaves is frozen
        print(gc.get_freeze_count() - before >= 10000)
        heap.freeze_warm_heap()
        frozen = gc.get_freeze_count()
        cycle = []
        cycle.append(cycle)
        del cycle
        print(gc.collect() >= 1)  # later garbage is still collected
        more = [[i] for i in range(1000)]
        gc.collect()
        print(gc.get_freeze_count() == frozen)  # and full collections no longer freeze
    """)
    assert out.split() == ["True", "True", "True"]


def test_a_process_the_command_did_not_start_keeps_its_collector_as_it_was():
    out = run_python("""
        kept = [[i] for i in range(10000)]
        heap.freeze_warm_heap()
        gc.collect()
        print(gc.get_freeze_count(), len(gc.callbacks))
    """)
    assert out.split() == ["0", "0"]
