"""Random legal einops-style patterns with mesh axes, for the rearrange, reduce and repeat
tests (not collected).

A case draws factors (``a``, ``b``, ...) with global sizes, groups them into the terms of an
input and an output side, and gives mesh axes only to factors that lead their term (or stand
alone) on both sides. It is a dict:

- ``pattern``: the ``shardops`` pattern, e.g. ``'(a b)/d c -> c a/d b'``;
- ``ann_in`` / ``ann_out``: shape specs of the input and output (a group is one dim);
- ``plain``: the einops pattern on the global arrays (the axes erased);
- ``sizes``: the keyword sizes (all factors of each input group, or all but one);
- ``shape``: the global input shape.

Also the checks the three tests share: a body run in ``typed_shard_map`` with annotations
made from text, and the phrases a refusal's message must hold.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from typing import Any

from shardlib.shardtypes import Array, f32, typed_shard_map
from tests._mesh_util import MESHES, make_mesh

_MESHES: dict[int, Any] = {}


def mesh_of(i: int) -> Any:
    """The mesh ``MESHES[i]`` (made once)."""
    if i not in _MESHES:
        _MESHES[i] = make_mesh(*MESHES[i])
    return _MESHES[i]


def mesh_sizes(mesh_index: int) -> tuple[tuple[str, ...], dict[str, int]]:
    """The axis names of ``MESHES[mesh_index]`` and their sizes."""
    shape, mesh_axes = MESHES[mesh_index]
    return mesh_axes, dict(zip(mesh_axes, shape, strict=True))


def assign_axes(rng: random.Random, mesh_axes, candidates: list[str]) -> dict[str, list[str]]:
    """Each mesh axis to one of ``candidates`` (or, now and then, to none)."""
    axes: dict[str, list[str]] = {}
    for a in rng.sample(list(mesh_axes), k=len(mesh_axes)):
        if candidates and rng.random() < 0.8:
            axes.setdefault(rng.choice(candidates), []).append(a)
    return axes


def global_sizes(
    rng: random.Random, names: list[str], axes: dict[str, list[str]], axis_size: dict[str, int]
) -> dict[str, int]:
    """A global size for each factor: a multiple of the sizes of the mesh axes that split it."""
    return {n: rng.randint(1, 3) * math.prod(axis_size[a] for a in axes.get(n, [])) for n in names}


def group(rng: random.Random, names: list[str], lead_only: set[str]) -> list[list[str]]:
    """Split ``names`` (in order) into terms; a sharded factor (``lead_only``) leads its term."""
    terms: list[list[str]] = []
    for n in names:
        if terms and n not in lead_only and rng.random() < 0.5:
            terms[-1].append(n)
        else:
            terms.append([n])
    return terms


def _side(rng: random.Random, terms: list[list[str]], axes: dict[str, list[str]], size, pre):
    """``(pattern side, annotation, global side, global shape)``; groups are ``pre0``..."""
    pat, ann, plain, shape = [], [], [], []
    for j, t in enumerate(terms):
        ax = "".join("/" + a for a in axes.get(t[0], []))
        shape.append(math.prod(size[n] for n in t))
        if len(t) > 1 or rng.random() < 0.2:
            pat.append(f"({' '.join(t)}){ax}")
            ann.append(f"{pre}{j}{ax}")
            plain.append(f"({' '.join(t)})")
        else:
            pat.append(t[0] + ax)
            ann.append(t[0] + ax)
            plain.append(t[0])
        if rng.random() < 0.1:
            pat.append("1")
            ann.append("1")
            plain.append("1")
            shape.append(1)
    return " ".join(pat), " ".join(ann), " ".join(plain), tuple(shape)


def _group_sizes(rng: random.Random, terms: list[list[str]], size: dict[str, int]) -> dict:
    """Keyword sizes for the input groups: all their factors, or all but one."""
    kw: dict[str, int] = {}
    for t in terms:
        if len(t) > 1:
            for n in rng.sample(t, k=rng.randint(len(t) - 1, len(t))):
                kw[n] = size[n]
    return kw


def make_case(
    rng: random.Random,
    ins: list[list[str]],
    outs: list[list[str]],
    axes: dict[str, list[str]],
    size: dict[str, int],
    new: Iterable[str] = (),
) -> dict[str, Any]:
    """The case of input terms ``ins`` and output terms ``outs``; ``new`` names the factors
    the output adds (their sizes are keywords too)."""
    pin, ain, gin, gshape = _side(rng, ins, axes, size, "G")
    pout, aout, gout, _ = _side(rng, outs, axes, size, "O")
    return dict(
        pattern=f"{pin} -> {pout}",
        ann_in=ain,
        ann_out=aout,
        plain=f"{gin} -> {gout}",
        sizes={**_group_sizes(rng, ins, size), **{n: size[n] for n in new}},
        shape=gshape,
    )


def typed_body(body: Callable[[Any], Any], ann_in: str, ann_out: str) -> Any:
    """``typed_shard_map`` of ``body(x)`` with ``x: f32[ann_in]`` and result ``f32[ann_out]``."""
    body.__annotations__ = {
        "x": f32[Array, ann_in.encode()],
        "return": f32[Array, ann_out.encode()],
    }
    return typed_shard_map(body)


def assert_phrases(msg: str, phrases: Iterable[str]) -> None:
    """Every phrase is in ``msg``."""
    for p in phrases:
        assert p in msg, (p, msg)


def assert_refusal(msg: str, op: str, pattern: str, phrases: Iterable[str]) -> None:
    """``msg`` refuses ``pattern`` as ``op``'s: it starts with ``'op: '``, shows the pattern
    with a caret under the fault, and holds every phrase."""
    assert msg.startswith(f"{op}: "), msg
    assert repr(pattern) in msg and "^" in msg, msg
    assert_phrases(msg, phrases)
