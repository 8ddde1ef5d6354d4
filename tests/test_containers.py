"""Containers of shardlib types: every item is checked, with names bound across items.

typeguard checks only the first item of a list, sequence, dict or ``tuple[X, ...]`` by
default; shardlib's checker checks them all, under ``shardlib.typechecked``, bare
``typeguard.typechecked`` and ``typeguard.check_type``, in one scope per call.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableSequence, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import typeguard
from jax.errors import JaxRuntimeError
from typeguard import TypeCheckError

import shardlib
from shardlib.shardtypes import Array, Scope, f32, i32, pytree_dataclass
from tests._mesh_util import make_mesh, place

DECORATORS = {"shardlib": shardlib.typechecked, "typeguard": typeguard.typechecked}


@pytree_dataclass
class Pair:
    w: f32[Array, b"N M"]
    b: f32[Array, b"M"]


def _functions(decorate):
    """One function per container annotation, decorated with ``decorate``."""

    def as_list(xs: list[f32[Array, b"N"]]) -> f32[Array, b"N"]:
        return sum(xs, jnp.zeros(xs[0].shape))

    def as_dict(xs: dict[str, f32[Array, b"N"]]) -> f32[Array, b"N"]:
        return sum(xs.values(), jnp.zeros(next(iter(xs.values())).shape))

    def as_mapping(xs: Mapping[str, f32[Array, b"N"]]) -> int:
        return len(xs)

    def as_sequence(xs: Sequence[f32[Array, b"N"]]) -> int:
        return len(xs)

    def as_mutable_sequence(xs: MutableSequence[f32[Array, b"N"]]) -> int:
        return len(xs)

    def as_tuple(xs: tuple[f32[Array, b"N"], ...]) -> int:
        return len(xs)

    def as_pairs(xs: list[tuple[f32[Array, b"N"], i32[Array, b"N"]]]) -> int:
        return len(xs)

    def as_nested(xs: dict[str, list[f32[Array, b"N"]]]) -> int:
        return len(xs)

    def as_dataclasses(xs: list[Pair]) -> int:
        return len(xs)

    fs = [as_list, as_dict, as_mapping, as_sequence, as_mutable_sequence, as_tuple]
    fs += [as_pairs, as_nested, as_dataclasses]
    return {f.__name__: decorate(f) for f in fs}


FUNCTIONS = {d: _functions(deco) for d, deco in DECORATORS.items()}


def _a(n: int, dtype=jnp.float32) -> jax.Array:
    return jnp.arange(n, dtype=dtype)


def _pair(n: int, m: int) -> Pair:
    return Pair(jnp.ones((n, m)), jnp.ones((m,)))


# name -> (a good value, [(a bad value, its path, a bullet of the message)]).
# In each bad value only an item after the first is wrong.
CASES = {
    "as_list": (
        [_a(3), _a(3), _a(3)],
        [
            ([_a(3), _a(3, jnp.int32)], "item 1", "dtype: expected float32, got int32"),
            ([_a(3), _a(3), jnp.ones((3, 2))], "item 2", "rank: expected 1 dim (N), got 2"),
            ([_a(3), _a(4)], "item 1", "dim 0 'N': expected size 3 (N=3 is already bound), got 4"),
        ],
    ),
    "as_dict": (
        {"a": _a(2), "b": _a(2)},
        [
            ({"a": _a(2), "b": _a(2, jnp.int32)}, "value of key 'b'", "dtype: expected float32"),
            ({"a": _a(2), "b": _a(5)}, "value of key 'b'", "(N=2 is already bound), got 5"),
            ({"a": _a(2), 3: _a(2)}, "key 3", "is not an instance of str"),
        ],
    ),
    "as_mapping": (
        {"a": _a(2)},
        [({"a": _a(2), "b": _a(3)}, "value of key 'b'", "(N=2 is already bound), got 3")],
    ),
    "as_sequence": (
        (_a(4), _a(4)),
        [
            ((_a(4), _a(4), _a(5)), "item 2", "(N=4 is already bound), got 5"),
            ([_a(4), _a(4, jnp.int32)], "item 1", "dtype: expected float32, got int32"),
        ],
    ),
    "as_mutable_sequence": (
        [_a(4), _a(4)],
        [([_a(4), _a(1)], "item 1", "(N=4 is already bound), got 1")],
    ),
    "as_tuple": (
        (_a(2), _a(2), _a(2)),
        [
            ((_a(2), _a(2), _a(2, jnp.int32)), "item 2", "dtype: expected float32, got int32"),
            ((_a(2), _a(3)), "item 1", "(N=2 is already bound), got 3"),
        ],
    ),
    "as_pairs": (
        [(_a(3), _a(3, jnp.int32)), (_a(3), _a(3, jnp.int32))],
        [
            (
                [(_a(3), _a(3, jnp.int32)), (_a(3), _a(3))],
                "item 1 of item 1",
                "dtype: expected int32, got float32",
            ),
            (
                [(_a(3), _a(3, jnp.int32)), (_a(3), _a(4, jnp.int32))],
                "item 1 of item 1",
                "(N=3 is already bound), got 4",
            ),
        ],
    ),
    "as_nested": (
        {"a": [_a(2), _a(2)], "b": [_a(2)]},
        [
            (
                {"a": [_a(2)], "b": [_a(2), _a(2), _a(6)]},
                "item 2 of value of key 'b'",
                "(N=2 is already bound), got 6",
            ),
        ],
    ),
    "as_dataclasses": (
        [_pair(2, 3), _pair(2, 3)],
        [
            (
                [_pair(2, 3), _pair(2, 4)],
                'field "w" of item 1',
                "dim 1 'M': expected size 3 (M=3 is already bound), got 4",
            ),
        ],
    ),
}


@pytest.mark.parametrize("deco", sorted(DECORATORS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_good_containers_are_accepted(deco, name):
    f = FUNCTIONS[deco][name]
    good = CASES[name][0]
    out = f(good)
    if name in ("as_list", "as_dict"):
        items = good if isinstance(good, list) else list(good.values())
        np.testing.assert_allclose(np.asarray(out), np.sum([np.asarray(x) for x in items], 0))
    else:
        assert out == len(good)


@pytest.mark.parametrize("deco", sorted(DECORATORS))
@pytest.mark.parametrize(
    ("name", "i"), [(name, i) for name, (_, bad) in sorted(CASES.items()) for i in range(len(bad))]
)
def test_every_item_is_checked(deco, name, i):
    f = FUNCTIONS[deco][name]
    value, path, bullet = CASES[name][1][i]
    with pytest.raises(TypeCheckError) as e:
        f(value)
    msg = str(e.value)
    assert f'{path} of argument "xs"' in msg, msg
    # (typeguard's own messages, for a str key, do not name the function)
    assert f"{name}()" in msg or (deco == "typeguard" and path.startswith("key")), msg
    assert bullet in msg, msg


@pytest.mark.parametrize("deco", sorted(DECORATORS))
def test_bindings_conflict_across_items_names_the_item_and_the_sizes(deco):
    f = FUNCTIONS[deco]["as_list"]
    with pytest.raises(TypeCheckError) as e:
        f([_a(3), _a(4)])
    msg = str(e.value)
    assert 'item 1 of argument "xs"' in msg and "as_list()" in msg, msg
    assert "dim 0 'N': expected size 3 (N=3 is already bound), got 4" in msg, msg
    assert "bindings: N=3" in msg, msg


@pytest.mark.parametrize("deco", sorted(DECORATORS))
def test_items_share_bindings_with_the_other_arguments_and_the_result(deco):
    @DECORATORS[deco]
    def stack(xs: list[f32[Array, b"N"]], y: f32[Array, b"N"]) -> list[f32[Array, b"N"]]:
        return [*xs, y] if y.shape[0] != 2 else [*xs, jnp.zeros(5)]

    assert len(stack([_a(3), _a(3)], _a(3))) == 3
    with pytest.raises(TypeCheckError, match=r"(?s)argument \"y\".*N=3 is already bound"):
        stack([_a(3), _a(3)], _a(4))
    with pytest.raises(TypeCheckError) as e:
        stack([_a(2), _a(2)], _a(2))
    msg = str(e.value)
    assert "item 2 of the return value" in msg and "(N=2 is already bound), got 5" in msg, msg


@pytest.mark.parametrize("deco", sorted(DECORATORS))
@pytest.mark.parametrize(
    ("name", "value", "kind"),
    [
        ("as_list", (_a(2),), "is not a list"),
        ("as_dict", [_a(2)], "is not a dict"),
        ("as_sequence", {_a(2).shape}, "is not a sequence"),
        ("as_tuple", [_a(2)], "is not a tuple"),
    ],
)
def test_a_value_of_the_wrong_container_kind_is_refused(deco, name, value, kind):
    with pytest.raises(TypeCheckError, match=f'argument "xs".*{kind}'):
        FUNCTIONS[deco][name](value)


def test_check_type_checks_every_item():
    with Scope():
        typeguard.check_type([_a(3), _a(3)], list[f32[Array, b"N"]])
    with Scope(), pytest.raises(TypeCheckError, match=r"(?s)item 2 of list .*N=3 is already bound"):
        typeguard.check_type([_a(3), _a(3), _a(7)], list[f32[Array, b"N"]])


def test_empty_containers_and_other_item_types():
    f = FUNCTIONS["shardlib"]
    assert f["as_sequence"]([]) == 0 and f["as_dict"]({"a": _a(2)}).shape == (2,)

    @shardlib.typechecked
    def mixed(xs: list[f32[Array, b"N"] | None], n: list[int]) -> int:
        return len(xs) + len(n)

    assert mixed([None, _a(2), None, _a(2)], [1]) == 5
    with pytest.raises(TypeCheckError, match=r"item 3 of argument \"xs\""):
        mixed([None, _a(2), None, _a(3)], [1])


@shardlib.typechecked
def sharded_items(xs: list[f32[Array, b"a/d b"]]) -> f32[Array, b"a/d b"]:
    return xs[0] + xs[1]


def test_layout_of_a_later_item_is_checked_eagerly_and_named_at_compile_time():
    x = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    mesh = make_mesh((8,), ("d",))
    with jax.set_mesh(mesh):
        good = place(x, mesh, "a/d b")
        np.testing.assert_allclose(np.asarray(sharded_items([good, good])), 2 * x)
        with pytest.raises(TypeCheckError) as e:
            sharded_items([good, place(x, mesh, "a b")])
        assert 'item 1 of argument "xs"' in str(e.value)
        assert "the annotation wants P('d', None)" in str(e.value)
    auto = make_mesh((8,), ("d",), auto=True)
    with jax.set_mesh(auto):
        good, bad = place(x, auto, "a/d b"), place(x, auto, "a b")
        lowered = jax.jit(sharded_items).lower([good, bad])
        with pytest.raises(JaxRuntimeError) as e:
            lowered.compile()
        want = "item 1 of argument \"xs\" in sharded_items() does not match f32['a/d b']"
        assert re.search(re.escape(want), str(e.value)), str(e.value)


def test_plain_containers_are_checked_item_by_item_too() -> None:
    """shardlib.typechecked checks every item of containers without shardlib types as well
    (its own typeguard configuration), not only the first."""

    @shardlib.typechecked
    def total(xs: list[int], names: dict[str, float]) -> int:
        return sum(xs) + len(names)

    assert total([1, 2, 3], {"a": 1.0}) == 7
    with pytest.raises(TypeCheckError, match=r"item 2"):
        total([1, 2, "3"], {"a": 1.0})  # type: ignore[list-item]
    with pytest.raises(TypeCheckError, match=r"value of key 'b'"):
        total([1], {"a": 1.0, "b": "x"})  # type: ignore[dict-item]
