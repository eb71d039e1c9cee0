"""Every ```python block of the README runs as written, each in a fresh namespace, in README order.

A block that cannot run here is preceded in the README source by
``<!-- readme-test: skip: <reason> -->``; the test is then skipped with that reason.
"""

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(?:<!-- readme-test: skip: (?P<skip>.+?) -->\n)?```python\n(?P<code>.*?)```", re.S)


@dataclass(frozen=True)
class Snippet:
    line: int
    code: str
    skip: str | None


def python_blocks(markdown: str) -> list[Snippet]:
    """The ```python blocks of ``markdown``, with their first line number and skip reason."""
    return [
        Snippet(markdown.count("\n", 0, m.start("code")) + 1, m["code"], m["skip"])
        for m in BLOCK.finditer(markdown)
    ]


SNIPPETS = python_blocks(README.read_text())


def test_blocks_are_found_with_their_skip_reasons():
    text = "# t\n```python\na = 1\n```\n<!-- readme-test: skip: needs a GPU -->\n```python\nb = 2\n```\n```sh\nc\n```\n"
    assert python_blocks(text) == [Snippet(3, "a = 1\n", None), Snippet(7, "b = 2\n", "needs a GPU")]
    assert len(SNIPPETS) >= 3


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"README.md:{s.line}" for s in SNIPPETS])
def test_readme_python_block_runs(snippet: Snippet):
    if snippet.skip is not None:
        pytest.skip(snippet.skip)
    torch._dynamo.reset()
    code = compile(snippet.code, f"README.md:{snippet.line}", "exec")
    exec(code, {"__name__": "__readme__"})
