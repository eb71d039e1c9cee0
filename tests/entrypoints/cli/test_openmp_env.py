"""``kvgraph serve`` sets OpenMP's spin count before torch loads, unless the user chose one."""

import os
import subprocess
import sys

import pytest

PROBE = """
import os, sys
from kvgraph.entrypoints.cli import main
assert "torch" not in sys.modules  # the command line imports torch only once it read its arguments
try:
    main(sys.argv[1:] + ["--help"])
except SystemExit:
    pass
assert "torch" in sys.modules
print(os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
"""


def probe(argv: list[str], **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    run = subprocess.run([sys.executable, "-c", PROBE, *argv], env={**base, **env}, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split("\n")[-2]


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        (["serve"], {}, "30000 None"),  # the server's default
        (["generate"], {}, "None None"),  # nothing for the other commands
        (["serve"], {"GOMP_SPINCOUNT": "200000"}, "200000 None"),  # the user's own value kept
        (["serve"], {"OMP_WAIT_POLICY": "active"}, "None active"),  # or their wait policy
    ],
)
def test_serve_sets_the_spin_count_before_torch_loads(argv, env, expected):
    assert probe(argv, **env) == expected


def test_nothing_is_set_once_torch_is_loaded():
    from kvgraph.entrypoints.cli.openmp_env import apply_serve_default

    assert "torch" in sys.modules  # libgomp has read its environment already: setting it would mislead
    environ: dict[str, str] = {}
    assert apply_serve_default(["serve"], environ) is None
    assert environ == {}
