"""Every ```python block of README.md and docs/ runs, page by page, as written.

Conventions for doc authors (also stated in docs/index.md's "About the snippets"):

- A page's ```python blocks run in order, in one namespace, in a fresh Python process, so a
  page states what its blocks share at its top (typically a first block that sets
  ``XLA_FLAGS`` for 8 simulated CPU devices before it imports jax). Nothing else is set up:
  ``XLA_FLAGS`` is removed from the environment the page runs in.
- Under pytest, the runner appends the tests' XLA flags (``tests/conftest.py``'s
  ``XLA_TEST_FLAGS``: the rendezvous timeouts and the quick-compile flags, passed in
  ``SHARDLIB_DOCS_XLA_FLAGS``) to the value a page assigns to ``os.environ["XLA_FLAGS"]``, so
  a late device thread on a loaded machine does not end the page and the page compiles as the
  tests do; the page's text is unchanged.
- A block that shows an error catches it: ``try: ... except SomeError as e: print(e)``. The
  runner asserts that every such ``try`` (one without an ``else``) did raise.
- Blocks that are not meant to run use another fence language: ```text for output, ```bash
  for shell, ```py for a fragment shown in Python highlighting (a signature, a line lifted
  from a larger program).

Blocks are compiled with the page's path as file name and their lines at the page's line
numbers, so a traceback (and ``inspect.getsource``) points into the markdown file.

Run one page by hand: ``python tests/test_docs_snippets.py docs/guide/remat.md``; all of them
with ``pytest -n auto --runslow tests/test_docs_snippets.py`` (the fast tier runs the README's).
"""

from __future__ import annotations

import ast
import linecache
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE_TIMEOUT_S = 300
_OPEN = re.compile(r"^```python(?:\s.*)?$")


def doc_pages() -> list[str]:
    """README.md and every docs/**/*.md page that has a ```python block, repo-relative."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p.relative_to(ROOT).as_posix() for p in pages if python_blocks(p)]


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(first code line, code) of each top-level ```python block of a markdown file."""
    blocks: list[tuple[int, str]] = []
    fence: str | None = None  # the open fence's language while inside a fenced block
    start, body = 0, []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if fence is None:
            if line.startswith("```"):
                fence = "python" if _OPEN.match(line) else "other"
                start, body = number + 1, []
        elif line.strip() == "```":
            if fence == "python":
                blocks.append((start, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    if fence is not None:
        raise ValueError(f"{path}: a ``` fence opened at line {start - 1} is never closed")
    return blocks


class _ExpectRaise(ast.NodeTransformer):
    """Give every ``try`` that has handlers and no ``else`` an ``else: raise AssertionError``.

    Function and class bodies are left alone: only code the block itself runs is asserted.
    """

    def __init__(self, page: str) -> None:
        self.page = page

    def visit_FunctionDef(self, node: ast.AST) -> ast.AST:
        return node

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_ClassDef = visit_FunctionDef

    def visit_Try(self, node: ast.Try) -> ast.AST:
        self.generic_visit(node)
        if node.handlers and not node.orelse:
            names = ", ".join(ast.unparse(h.type) for h in node.handlers if h.type is not None)
            message = f"{self.page}:{node.lineno}: the try block was expected to raise {names}"
            fail = ast.parse(f"raise AssertionError({message!r})").body[0]
            node.orelse = [ast.copy_location(fail, node)]
            ast.fix_missing_locations(node)
        return node


EXTRA_FLAGS_ENV = "SHARDLIB_DOCS_XLA_FLAGS"


class _ExtraXlaFlags(ast.NodeTransformer):
    """Append ``extra`` to every ``os.environ["XLA_FLAGS"] = value`` a block runs."""

    def __init__(self, extra: str) -> None:
        self.extra = extra

    def visit_Assign(self, node: ast.Assign) -> ast.AST:
        target = node.targets[0] if len(node.targets) == 1 else None
        if (
            self.extra
            and isinstance(target, ast.Subscript)
            and ast.unparse(target.value) == "os.environ"
            and isinstance(target.slice, ast.Constant)
            and target.slice.value == "XLA_FLAGS"
        ):
            extra = ast.Constant(" " + self.extra)
            node.value = ast.copy_location(ast.BinOp(node.value, ast.Add(), extra), node.value)
            ast.fix_missing_locations(node)
        return node


def _register_source(page: str, blocks: list[tuple[int, str]]) -> None:
    """Make ``page``'s source, for ``inspect``, the page with every non-code line blanked.

    That is valid Python with the blocks at their page line numbers, so tools that re-read a
    function's module source (``typeguard.typechecked`` parses the whole module) work, and
    tracebacks still show the page's lines. ``mtime=None`` keeps ``linecache.checkcache``
    from replacing it with the markdown file itself.
    """
    total = len((ROOT / page).read_text(encoding="utf-8").splitlines())
    lines = ["\n"] * total
    for start, code in blocks:
        for offset, text in enumerate(code.splitlines()):
            lines[start - 1 + offset] = text + "\n"
    linecache.cache[page] = (sum(map(len, lines)), None, lines, page)


def run_page(page: str) -> None:
    """Run ``page``'s python blocks in order in this process (the subprocess side)."""
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    # The page is the __main__ module, as a script would be: dataclasses and typing resolve
    # annotations through sys.modules[cls.__module__].
    main = types.ModuleType("__main__")
    main.__file__ = page
    sys.modules["__main__"] = main
    namespace = main.__dict__
    blocks = python_blocks(ROOT / page)
    _register_source(page, blocks)
    for line, code in blocks:
        tree = ast.parse(code, filename=page)
        ast.increment_lineno(tree, line - 1)
        tree = _ExpectRaise(page).visit(tree)
        tree = _ExtraXlaFlags(os.environ.get(EXTRA_FLAGS_ENV, "")).visit(tree)
        print(f"--- {page}:{line}", flush=True)
        t0 = time.perf_counter()
        exec(compile(tree, page, "exec"), namespace)
        sys.stdout.flush()
        print(f"--- {page}:{line} done in {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    run_page(sys.argv[1])
    sys.exit(0)


import pytest  # noqa: E402  (the subprocess side above needs no pytest)

from tests.conftest import XLA_TEST_FLAGS  # noqa: E402  (nor the test setup)


def _page_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # each page sets up its own devices, as a reader's run would
    env[EXTRA_FLAGS_ENV] = " ".join(XLA_TEST_FLAGS)  # appended to the page's XLA_FLAGS
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# The fast tier runs the README's blocks; every other page (10 to 100 s each: a fresh process
# that imports JAX and compiles a guide's worth of programs) runs in the slow tier.
FAST_PAGES = ("README.md",)


@pytest.mark.parametrize(
    "page",
    [p if p in FAST_PAGES else pytest.param(p, marks=pytest.mark.slow) for p in doc_pages()],
)
@pytest.mark.timeout(PAGE_TIMEOUT_S + 60)
def test_page_runs(page: str) -> None:
    proc = subprocess.run(
        [sys.executable, __file__, page],
        cwd=ROOT,
        env=_page_env(),
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
    )
    if proc.returncode != 0:
        started = re.findall(r"^--- (\S+:\d+)$", proc.stdout, flags=re.M)
        where = started[-1] if started else page
        pytest.fail(
            f"the python block at {where} failed (exit {proc.returncode}); run it with "
            f"`python tests/test_docs_snippets.py {page}`\n"
            f"--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}",
            pytrace=False,
        )


def test_every_page_with_code_is_collected() -> None:
    """The README and the pages that teach the API all carry runnable blocks."""
    pages = set(doc_pages())
    for must in ("README.md", "docs/index.md", "docs/shape-language.md"):
        assert must in pages, f"{must} has no ```python block: did a fence language change?"


def test_fragments_are_not_python_fences() -> None:
    """A ```python fence is only opened at column 0 (indented ones would not run)."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```python") and not line.startswith("```"):
                pytest.fail(f"{page.relative_to(ROOT)}:{number}: indented ```python block")
