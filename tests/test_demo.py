"""`python -m kvgraph.demo` (what `make demo` runs): output and exit status."""

from __future__ import annotations

import re

import pytest

from kvgraph import demo


@pytest.mark.parametrize("argv", [[], ["--strategy", "continuous", "--dtype", "bfloat16"]], ids=["paged", "continuous"])
def test_demo_runs_and_every_step_matches(argv, capsys):
    assert demo.main([*argv, "--decode-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("all steps match the float64 golden")
    assert len(re.findall(r"max error vs float64 golden", out)) == 4  # prefill + 3 decodes
    assert "release seq 1" in out and "prefill of seq 1" in out  # the late sequence takes the freed slot


def test_paged_demo_prints_page_tables_and_occupancy(capsys):
    assert demo.main(["--page-size", "4", "--decode-steps", "2"]) == 0
    out = capsys.readouterr().out
    # the 11-token prompt takes three pages of 4
    assert re.search(r"seq 1: cached +0 \+ new 11 -> pages \[\d+, \d+, \d+\]", out)
    assert "pages used 6/16, free 10" in out
    assert out.count("pages used 0/16, free 16") == 2  # empty before the first claim and after the last release


def test_demo_exits_non_zero_on_a_mismatch(monkeypatch, capsys):
    real = demo.attention

    def off_by_a_bit(*args):
        return real(*args) + 1e-3

    monkeypatch.setattr(demo, "attention", off_by_a_bit)
    assert demo.main(["--decode-steps", "1"]) == 1
    captured = capsys.readouterr()
    assert "MISMATCH: prefill: max error" in captured.err
    assert "all steps match" not in captured.out

