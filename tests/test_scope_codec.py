"""The named-scope codec (`shardlib._lang.scope_codec`): each kind's text reads back as itself,
inside any name stack JAX writes around it, and no other module writes or reads a scope's text.
"""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path

import pytest

from shardlib._lang.scope_codec import (
    AttentionGridScope,
    AttentionScope,
    MoeLayerScope,
    OpScope,
    ScheduleScope,
    ScopeKind,
)

KINDS: tuple[type[ScopeKind], ...] = (
    OpScope,
    ScheduleScope,
    AttentionScope,
    AttentionGridScope,
    MoeLayerScope,
)
_NAMES = ("d", "t", "p", "c", "e", "data", "seq_1")


def _random_scope(kind: type[ScopeKind], rng: random.Random) -> ScopeKind:
    """A scope of ``kind`` with random fields of the kinds its producers write."""
    name, n = (lambda: rng.choice(_NAMES)), (lambda: rng.randint(1, 4096))
    if kind is OpScope:
        specs = ("B M", "B/d M -> B M", "B M, M/t F -> B F/t", "B [L/c] H -> B H", "")
        return OpScope(rng.choice(("psum", "all_gather", "einsum", "shift")), rng.choice(specs))
    if kind is ScheduleScope:
        res = rng.choice((None, n()))
        back = rng.choice((None, "split", "whole"))
        sched = rng.choice(("gpipe", "circular", "1f1b", "zb_h1", "zb_v", "interleaved"))
        return ScheduleScope(sched, name(), n(), n(), n(), res, back)
    if kind is AttentionScope:
        fn = rng.choice(("ring", "gathered", "ulysses", "decode"))
        return AttentionScope(fn, name(), n(), rng.choice(("contiguous", "balanced")))
    if kind is AttentionGridScope:
        return AttentionGridScope("ring_ulysses", name(), name())
    return MoeLayerScope(name(), n(), n(), n(), n(), n(), rng.choice((1, 2, 4)))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_every_scope_reads_back_as_itself_inside_any_stack(kind: type[ScopeKind]) -> None:
    """200 random scopes per kind: `find` returns exactly the scope (and its text) inside
    transforms and before or after other kinds' scopes; `innermost` takes the last one."""
    rng = random.Random(52)
    for _ in range(200):
        scope = _random_scope(kind, rng)
        text = scope.text()
        others = [_random_scope(k, rng).text() for k in KINDS if k is not kind]
        rng.shuffle(others)
        head, tail = others[: len(others) // 2], others[len(others) // 2 :]
        stack = "/".join(["jit(step)", *head, rng.choice(("jvp({})", "{}")).format(text), *tail])
        stack = rng.choice(("{}", "transpose({})")).format(stack)
        assert kind.find(stack) == [(text, scope)], stack
        assert kind.present(stack)
        inner = _random_scope(kind, rng)
        assert kind.innermost(f"{stack}/{inner.text()}") == inner


def test_no_kind_reads_another_kinds_scope() -> None:
    """Attention's two kinds share a prefix; neither pattern matches the other's text."""
    rng = random.Random(0)
    for kind in KINDS:
        for other in KINDS:
            if other is not kind:
                assert kind.find(_random_scope(other, rng).text()) == []


def test_the_formats_are_the_ones_profiles_and_explain_have_always_shown() -> None:
    """The texts themselves (HLO metadata and profiles carry them; changing one is a change
    users see)."""
    assert OpScope("psum", "B M").text() == "shardops.psum[B M]"
    assert (
        ScheduleScope("zb_h1", "p", 2, 4, 1, 640, "split").text()
        == "shardlib.pipeline.zb_h1[axis=p p=2 m=4 v=1 res_bytes=640 backward=split]"
    )
    assert (
        ScheduleScope("gpipe", "p", 2, 4, 1).text() == "shardlib.pipeline.gpipe[axis=p p=2 m=4 v=1]"
    )
    assert (
        AttentionScope("ring", "c", 4, "balanced").text()
        == "shardlib.attention.ring[axis=c c=4 layout=balanced]"
    )
    assert (
        AttentionGridScope("ring_ulysses", "r", "u").text()
        == "shardlib.attention.ring_ulysses[ring=r ulysses=u]"
    )
    assert (
        MoeLayerScope("e", 4, 8, 20, 2, 64, 4).text()
        == "shardlib.moe.layer[axis=e e=4 E=8 C=20 k=2 M=64 itemsize=4]"
    )


# -- one place: no other module spells a scope ---------------------------------------------

SHARDLIB = Path(__file__).resolve().parent.parent / "shardlib"
CODEC = "_lang/scope_codec.py"
# A scope's text being written or read: a prefix followed by a name and ``[`` (or by a
# formatted name), or a prefix alone (a constant to search a stack with).
_SPELLED = re.compile(
    r"(shardops\.|shardlib\.pipeline\.|shardlib\.attention\.)(\w+|\{[^}]*\})\[|shardlib\.moe\.layer\["
)
_PREFIXES = {"shardops.", "shardlib.pipeline.", "shardlib.attention.", "shardlib.moe.layer"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of ``tree`` (prose: they may show a scope)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            found.add(id(body[0].value))
    return found


def _spelled(text: str) -> list[str]:
    """The places in module source ``text`` that write or read a named scope's text."""
    tree = ast.parse(text)
    docs = _docstrings(tree)  # and the parts of f-strings (read whole below)
    docs |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in _PREFIXES or _SPELLED.search(node.value):
                found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.JoinedStr) and _SPELLED.search(ast.unparse(node)):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_codec_spells_a_scope() -> None:
    """Every named scope is written and read through `shardlib._lang.scope_codec`: no other
    module of shardlib has a scope's prefix or format in its code (docstrings aside)."""
    spelled = [
        f"{path.relative_to(SHARDLIB).as_posix()}: {hit}"
        for path in sorted(SHARDLIB.rglob("*.py"))
        if path.relative_to(SHARDLIB).as_posix() != CODEC
        for hit in _spelled(path.read_text())
    ]
    assert not spelled, f"named scopes spelled outside shardlib/{CODEC}: {spelled}"
    # The check sees what it is for (so it cannot pass vacuously).
    assert _spelled((SHARDLIB / CODEC).read_text())
    assert _spelled('x = f"shardlib.attention.{fn}[axis={a}]"\n')
    assert _spelled('P = "shardops."\n')
    assert not _spelled('"""shardlib.attention.ring[axis=c] in prose."""\n')
