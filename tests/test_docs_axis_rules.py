"""docs/guide/axis-rules.md quotes the real output of its blocks.

The page's ```text blocks paste what its ```python blocks print (the multi-mesh comparison
and the error messages users meet under bad rules). test_docs_snippets only runs the blocks;
this test also checks that every ```text block still appears, line for line, in what the
page prints, so a changed message cannot leave a stale quote behind.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import test_docs_snippets as snippets

PAGE = "docs/guide/axis-rules.md"


def text_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of each top-level ```text block of a markdown file."""
    blocks: list[tuple[int, str]] = []
    inside: str | None = None
    start, body = 0, []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if inside is None:
            if line.startswith("```"):
                inside = line[3:].strip()
                start, body = number + 1, []
        elif line.strip() == "```":
            if inside == "text":
                blocks.append((start, "\n".join(body)))
            inside = None
        else:
            body.append(line)
    return blocks


def _lines(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines())


@pytest.mark.slow
def test_axis_rules_page_quotes_real_output() -> None:
    proc = subprocess.run(
        [sys.executable, snippets.__file__, PAGE],
        cwd=snippets.ROOT,
        env=snippets._page_env(),
        capture_output=True,
        text=True,
        timeout=snippets.PAGE_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{PAGE} failed to run:\n{proc.stderr[-3000:]}"
    printed = _lines(proc.stdout)
    blocks = text_blocks(snippets.ROOT / PAGE)
    assert len(blocks) >= 6, f"{PAGE}: expected its ```text blocks of output, found {len(blocks)}"
    stale = [f"{PAGE}:{line}:\n{text}" for line, text in blocks if _lines(text) not in printed]
    assert not stale, "quoted output the page no longer prints:\n\n" + "\n\n".join(stale)
