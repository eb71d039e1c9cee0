"""Run the ``kvgraph`` command line as users do: a subprocess of this interpreter."""

import subprocess
import sys

import pytest

FAST = ["--compile", "eager", "--max-batch-size", "4"]


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvgraph.entrypoints.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="session")
def kvgraph_cli():
    """``kvgraph_cli(*args)`` -> ``CompletedProcess`` (stdout, stderr, returncode)."""
    return _run


@pytest.fixture(scope="session")
def fast_flags():
    """Engine flags that keep a CLI run small: eager inner compiler, 4 sequences."""
    return list(FAST)

