"""CompileProgress: the stages of a compiling call, one line each or redrawn in place on a terminal."""

import io

import pytest

from kvgraph.engine import progress as progress_module
from kvgraph.engine.progress import CAPTURE_STAGE, LAST_PASS, LOWER_STAGE, CompileProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def note_not_yet_given(monkeypatch):
    monkeypatch.setattr(progress_module, "_noted", progress_module.threading.Event())


def _compile_once(shown: CompileProgress) -> None:
    with shown.compiling("graph 1 of 2"):
        shown.dump("captured", None)
        shown.dump("find_attention", None)
        shown.dump(LAST_PASS, None)


def test_each_stage_is_a_line_when_the_stream_is_not_a_terminal():
    out = io.StringIO()
    shown = CompileProgress("inductor", out)
    _compile_once(shown)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("kvgraph: the first step compiles a graph")
    assert "faster from Inductor's on-disk cache" in lines[0]
    stages = [line.split(": ", 2)[2].rsplit(" (", 1)[0] for line in lines[1:4]]
    assert stages == [CAPTURE_STAGE, LOWER_STAGE, "compiling the lowered graph with inductor and running it once"]
    assert lines[4].startswith("kvgraph: compiled graph 1 of 2 in ") and lines[4].endswith("s")
    assert len(lines) == 5 and "\r" not in out.getvalue()


def test_the_note_about_compiling_comes_once_per_process():
    out = io.StringIO()
    shown = CompileProgress("eager", out)
    _compile_once(shown)
    _compile_once(CompileProgress("eager", out))
    assert out.getvalue().count("kvgraph: the first step") == 1
    assert "on-disk cache" not in out.getvalue()  # eager compiles nothing to cache


def test_a_terminal_gets_one_line_redrawn_in_place_and_the_result():
    out = Terminal()
    _compile_once(CompileProgress("eager", out))
    text = out.getvalue()
    assert "\r\033[K" in text and f"kvgraph: compiling graph 1 of 2: {CAPTURE_STAGE}" in text
    assert text.rstrip("\n").rsplit("\r\033[K", 1)[1].startswith("kvgraph: compiled graph 1 of 2 in ")
    assert text.count("\n") == 2  # the note and the result: the stages are redrawn, not appended


def test_a_graph_loaded_from_its_precompiled_file_says_so():
    out = io.StringIO()
    shown = CompileProgress("inductor", out)
    with shown.loading("graph 1 of 2"):
        pass
    lines = out.getvalue().splitlines()
    assert lines[0] == "kvgraph: loading graph 1 of 2 from its precompiled file"
    assert lines[1].startswith("kvgraph: loaded graph 1 of 2 in ") and len(lines) == 2
