"""The README's capability table: every public module is in it, every link resolves.

A reader of the README learns what the library can do from that table; a capability added
without a row, or a guide renamed under it, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _table() -> str:
    start = README.index("## What it can do")
    return README[start : README.index("\n## ", start + 1)]


def test_every_capability_row_links_to_a_page_that_exists() -> None:
    table = _table()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 10, rows
    for row in rows[1:]:  # the header row has no link
        links = re.findall(r"\]\(([^)]+)\)", row)
        assert links, f"README capability row without a guide link: {row}"
        for link in links:
            assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"


def test_every_public_module_has_a_row() -> None:
    table = _table()
    for name in ("typed_shard_map", "shardops.", "pipeline.", "attention.", "moe.", "explain",
                 "jax_extra.", "restore_target", "{+t}"):  # fmt: skip
        assert name in table, f"README's capability table does not mention {name}"
    for schedule in ("GPipe", "circular", "1F1B", "interleaved", "ZB-H1"):
        assert schedule in table, schedule
