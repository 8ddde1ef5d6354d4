"""Architecture rules that a reader can rely on, checked on the source of ``shardlib/``."""

from __future__ import annotations

import ast
from pathlib import Path

SHARDLIB = Path(__file__).resolve().parent.parent / "shardlib"


def _sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(SHARDLIB.glob("*.py"))}


def test_no_source_parsing_and_frames_read_in_one_module() -> None:
    """shardlib never reads source text; only ``_frames.py`` reads Python frames."""
    parsing = [
        f"{name}: {word}"
        for name, text in _sources().items()
        for word in ("inspect.getsource", "ast.parse")
        if word in text
    ]
    assert not parsing, f"source parsing in shardlib: {parsing}"
    frames = [
        f"{name}: {word}"
        for name, text in _sources().items()
        if name != "_frames.py"
        for word in ("sys._getframe", "f_back", "currentframe")
        if word in text
    ]
    assert not frames, f"frame access outside shardlib/_frames.py: {frames}"


# Size limits: a module a newcomer can read in one sitting, a function that fits on a screen.
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
# Modules and functions allowed over the limits, each with the reason. Keep this short.
OVER_LIMITS: dict[str, str] = {}
PACKAGES = ("shardlib", "jax_extra", "benchmarks")


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``node``'s code, its docstring excluded (docstrings are examples and prose)."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if not body:
        return 0
    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    doc = node.body[0] if body is not node.body else None
    doc_lines = (doc.end_lineno - doc.lineno + 1) if doc is not None and doc.end_lineno else 0
    return (node.end_lineno or node.lineno) - start + 1 - doc_lines


def _oversized() -> list[str]:
    root = SHARDLIB.parent
    found: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            text = path.read_text()
            n = text.count("\n")
            if n > MAX_MODULE_LINES:
                found.append(f"{rel} ({n} lines)")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    size = _function_lines(node)
                    if size > MAX_FUNCTION_LINES:
                        found.append(f"{rel}:{node.name} ({size} lines)")
    return found


def test_modules_and_functions_stay_small() -> None:
    """No module over 450 lines, no function over 60 (docstring excluded), but the listed."""
    over = _oversized()
    unexplained = [o for o in over if o.split(" (")[0] not in OVER_LIMITS]
    assert not unexplained, (
        f"over the size limits ({MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a "
        f"function): {unexplained}; split them, or list them in OVER_LIMITS with the reason"
    )
    stale = [k for k in OVER_LIMITS if not any(o.startswith(k + " (") for o in over)]
    assert not stale, f"OVER_LIMITS lists entries that are within the limits now: {stale}"
