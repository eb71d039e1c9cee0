"""The ``kvgraph`` process's exit: its status, every exit handler run, no module teardown after them."""

import subprocess
import sys
import textwrap

import pytest

from kvgraph.entrypoints.cli.process_exit import exit_status


def run_python(body: str, tmp_path) -> subprocess.CompletedProcess:
    """``body`` as a script: it defines ``main`` and may use ``log`` (a file under ``tmp_path``)."""
    script = textwrap.dedent(f"""
        import atexit, sys
        from kvgraph.entrypoints.cli.process_exit import run_and_exit
        log = open({str(tmp_path / "log")!r}, "a", buffering=1)
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("code, status", [(None, 0), (0, 0), (3, 3), (256 + 7, 7), ("bad", 1), (True, 1)])
def test_exit_status_is_what_sys_exit_would_give(code, status):
    assert exit_status(code) == status


@pytest.mark.parametrize("ending, status", [("return 3", 3), ("return None", 0), ("sys.exit(2)", 2)])
def test_the_process_exits_with_the_commands_status_after_its_exit_handlers_and_skips_the_teardown(
    ending, status, tmp_path
):
    done = run_python(f"""
        import os

        class TornDown:
            # what it needs bound now: a teardown may have cleared the modules and closed `log`
            def __del__(self, path=log.name, open_=os.open, write=os.write, flags=os.O_WRONLY | os.O_APPEND):
                write(open_(path, flags), b"torn down\\n")

        held = TornDown()  # a module global: only a module teardown deletes it

        def main():
            atexit.register(lambda: log.write("handler\\n"))
            print("x" * 100000, end="")  # more than a pipe's buffer: the ender flushes it
            {ending}

        run_and_exit(main)
    """, tmp_path)
    assert done.returncode == status, done.stderr
    assert done.stdout == "x" * 100000
    assert (tmp_path / "log").read_text() == "handler\n"


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(tmp_path):
    done = run_python("""
        def main():
            raise ValueError("the command failed")

        run_and_exit(main)
    """, tmp_path)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "ValueError: the command failed" in done.stderr


def test_the_command_line_keeps_its_statuses_and_output():
    version = subprocess.run([sys.executable, "-m", "kvgraph", "--version"], capture_output=True, text=True,
                             timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("kvgraph ")
    bad = subprocess.run([sys.executable, "-m", "kvgraph.entrypoints.cli", "generate", "--max-new-tokens", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "error: argument --max-new-tokens: must be a positive int, got 0" in bad.stderr
