"""Tests for the spec language: shapes (shardlib._lang.parsing) and op-spec plans (shardlib._ops.collective_recipes).

Error tests compare the *whole* message: the message line, the spec as repr() shows it, the
caret line (built here from the column of the fault, so a misplaced caret fails) and the hint.
"""

from __future__ import annotations

import ast
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from shardlib._lang.op_spec import OpSpec, parse_op_spec
from shardlib._lang.parsing import DimSpec, ShapeSpec, SpecError
from shardlib._ops.collective_recipes import (
    all_gather_recipe,
    all_reduce_recipe,
    all_to_all_recipe,
    einsum_recipe,
    index_recipe,
    parse_axes,
    psum_scatter_recipe,
)
from tests import _fuzz_text as fuzz
from tests._tiers import examples

D = DimSpec


def expected_error(message: str, spec: str, col: int | None, width: int = 1, hint=None) -> str:
    """The full SpecError text for a fault at character ``col`` of a plain-ASCII ``spec``.

    ``col=None``: no caret line. The caret sits under ``spec[col]`` as printed by repr(): four
    spaces of indent, the opening quote, then ``col`` characters.
    """
    lines = [message, f"    {spec!r}"]
    if col is not None:
        lines.append(" " * (5 + col) + "^" * width)
    if hint is not None:
        lines.append(f"hint: {hint}")
    return "\n".join(lines)


def raises_spec_error(fn, *args, **kwargs) -> SpecError:
    with pytest.raises(SpecError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert isinstance(err, ValueError)
    return err


# ---------------------------------------------------------------------------------------------
# 1. Good shape specs
# ---------------------------------------------------------------------------------------------

GOOD_SHAPES = [
    # (spec, dims, canonical str, PartitionSpec)
    ("batch/d len", (D("batch", ("d",)), D("len")), "batch/d len", P("d", None)),
    ("M/t/d", (D("M", ("t", "d")),), "M/t/d", P(("t", "d"))),
    ("2 M", (D(2), D("M")), "2 M", P(None, None)),
    ("", (), "", P()),
    ("   ", (), "", P()),
    ("  a \t b/x\t\t", (D("a"), D("b", ("x",))), "a b/x", P(None, "x")),
    ("a\nb\r\nc", (D("a"), D("b"), D("c")), "a b c", P(None, None, None)),
    ("in for/if", (D("in"), D("for", ("if",))), "in for/if", P(None, "if")),
    ("_x1 y_/_z", (D("_x1"), D("y_", ("_z",))), "_x1 y_/_z", P(None, "_z")),
    ("0 007 4/d", (D(0), D(7), D(4, ("d",))), "0 7 4/d", P(None, None, "d")),
    (
        "B/d L/t M/x/y",
        (D("B", ("d",)), D("L", ("t",)), D("M", ("x", "y"))),
        "B/d L/t M/x/y",
        P("d", "t", ("x", "y")),
    ),
    ("a a", (D("a"), D("a")), "a a", P(None, None)),  # a repeated name: same size, checked later
]


@pytest.mark.parametrize("as_bytes", [False, True], ids=["str", "bytes"])
@pytest.mark.parametrize(("spec", "dims", "canonical", "pspec"), GOOD_SHAPES)
def test_good_shape_specs(spec, dims, canonical, pspec, as_bytes):
    parsed = ShapeSpec.parse(spec.encode() if as_bytes else spec)
    assert parsed.dims == dims
    assert parsed == ShapeSpec(dims)
    assert str(parsed) == canonical
    assert ShapeSpec.parse(str(parsed)) == parsed
    assert len(parsed) == len(dims)
    assert parsed.partition_spec() == pspec
    assert isinstance(parsed.partition_spec(), P)
    assert parsed.mesh_axes() == tuple(a for d in dims for a in d.sharding)


def test_dim_spec_parse_and_properties():
    assert DimSpec.parse("batch/d/t") == D("batch", ("d", "t"))
    assert DimSpec.parse(b" 12 ") == D(12)
    assert DimSpec.parse("12").is_literal
    assert not DimSpec.parse("n").is_literal
    assert str(D(3, ("a", "b"))) == "3/a/b"
    err = raises_spec_error(DimSpec.parse, "a b/d")
    assert str(err) == expected_error("expected exactly one dimension, got 2", "a b/d", 0, 5)


def test_non_string_spec_is_a_type_error():
    with pytest.raises(TypeError, match=r"a shape spec must be str or bytes, got int: 3"):
        ShapeSpec.parse(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# 2. Bad shape specs: full messages
# ---------------------------------------------------------------------------------------------

ARROW_HINT = "arrows '->' belong in shardops op specs such as 'a/d b -> a b', not in a shape spec"
SIZE_MSG = "a dim size is a Python identifier or a non-negative integer"
TWICE = "mesh axis 'd' is used twice: an axis can shard at most one dim, once"
AXIS_MSG = "mesh axes are Python identifiers"
AXIS_HINT = "write the mesh axis name as given to the Mesh, e.g. 'batch/d'"
ASCII_HINT = "specs are ASCII: dim names and mesh axes are ASCII identifiers"

# fmt: off
BAD_SHAPES = [
    # (spec, message, column of the fault, caret width, hint)
    # empty names
    ("a//d", "empty mesh axis between '/' and '/'", 2, 1, "remove the extra '/': did you mean 'a/d'?"),
    ("x a//d/e", "empty mesh axis between '/' and '/'", 4, 1, "remove the extra '/': did you mean 'x a/d/e'?"),
    ("a/", "missing mesh axis after '/'", 1, 1, "remove the trailing '/' or name an axis: did you mean 'a'?"),
    ("a b/d/", "missing mesh axis after '/'", 5, 1, "remove the trailing '/' or name an axis: did you mean 'a b/d'?"),
    ("/d", "missing dim size before '/'", 0, 1, "write NAME/axis, e.g. 'batch/d'"),
    ("a /", "missing dim size before '/'", 2, 1, "write NAME/axis, e.g. 'batch/d'"),
    # a mesh axis used twice
    ("a/d b/d", TWICE, 6, 1, "remove one of the two '/d' (first used by dim 'a/d')"),
    ("a/d/d", TWICE, 4, 1, "remove one of the two '/d' (first used by dim 'a/d/d')"),
    ("a/t/d b c/x/d", TWICE, 12, 1, "remove one of the two '/d' (first used by dim 'a/t/d')"),
    # commas
    ("a,b", "unexpected character ',' in dim 'a,b'", 1, 1,
     "separate dims with spaces, not commas (commas separate operands in shardops op specs): "
     "did you mean 'a b'?"),
    ("x/d, y", "unexpected character ',' in dim 'x/d,'", 3, 1,
     "separate dims with spaces, not commas (commas separate operands in shardops op specs): "
     "did you mean 'x/d y'?"),
    # arrows
    ("a->b", "an arrow '->' is not allowed in a shape spec", 1, 2,
     "arrows belong in shardops op specs such as 'a/d b -> a b'"),
    ("a/d b -> a b", "an arrow '->' is not allowed in a shape spec", 6, 2,
     "arrows belong in shardops op specs such as 'a/d b -> a b'"),
    ("a >", "unexpected character '>' in dim '>'", 2, 1, ARROW_HINT),
    ("a -", "unexpected character '-' in dim '-'", 2, 1, ARROW_HINT),
    ("a- > b", "unexpected character '-' in dim 'a-'", 1, 1, ARROW_HINT),
    # other punctuation
    ("a.b", "unexpected character '.' in dim 'a.b'", 1, 1, "ellipses and dots are not supported; name every dim"),
    ("x ...", "unexpected character '.' in dim '...'", 2, 1, "ellipses and dots are not supported; name every dim"),
    ("a*b", "unexpected character '*' in dim 'a*b'", 1, 1,
     "write the size as a name or an integer; products are not supported"),
    ("a(b)", "unexpected character '(' in dim 'a(b)'", 1, 1, "parentheses are not supported; name every dim"),
    ("a:d", "unexpected character ':' in dim 'a:d'", 1, 1,
     "write 'name/axis' to shard a dim over a mesh axis: did you mean 'a/d'?"),
    ("b a@t", "unexpected character '@' in dim 'a@t'", 3, 1,
     "write 'name/axis' to shard a dim over a mesh axis: did you mean 'b a/t'?"),
    ("[V] M", "unexpected character '[' in dim '[V]'", 0, 1,
     "brackets mark the looked-up dim in index_unreduced op specs only"),
    ("a+b", "unexpected character '+' in dim 'a+b'", 1, 1,
     "dims are NAME or NAME/axis/axis, separated by spaces"),
    ("d-model", "unexpected character '-' in dim 'd-model'", 1, 1,
     "'-' cannot appear in names: did you mean 'd_model'?"),
    ("a/-x", "unexpected character '-' in dim 'a/-x'", 2, 1,
     "'-' cannot appear in dims; dims are NAME or NAME/axis/axis"),
    # neither identifiers nor non-negative integers
    ("1a", f"invalid dim size '1a': {SIZE_MSG}", 0, 2,
     "names start with a letter or '_' (e.g. 'len2', not '2len')"),
    ("b 2x/d", f"invalid dim size '2x': {SIZE_MSG}", 2, 2,
     "names start with a letter or '_' (e.g. 'len2', not '2len')"),
    ("-1", "unexpected character '-' in dim '-1'", 0, 1,
     "a dim size is a name or a non-negative integer"),
    ("a/1", f"invalid mesh axis name '1': {AXIS_MSG}", 2, 1, AXIS_HINT),
    ("a/d/9lives", f"invalid mesh axis name '9lives': {AXIS_MSG}", 4, 6, AXIS_HINT),
    # non-ASCII
    ("é", "non-ASCII character 'é' (U+00E9 LATIN SMALL LETTER E WITH ACUTE) in dim 'é'", 0, 1,
     ASCII_HINT),
    ("a b/δ", "non-ASCII character 'δ' (U+03B4 GREEK SMALL LETTER DELTA) in dim 'b/δ'", 4, 1,
     ASCII_HINT),
    ("x ²", "non-ASCII character '²' (U+00B2 SUPERSCRIPT TWO) in dim '²'", 2, 1, ASCII_HINT),
    ("a → b", "non-ASCII character '→' (U+2192 RIGHTWARDS ARROW) in dim '→'", 2, 1,
     "arrows '->' belong in shardops op specs such as 'a/d b -> a b', not in a shape spec"),
]
# fmt: on


@pytest.mark.parametrize(("spec", "message", "col", "width", "hint"), BAD_SHAPES)
def test_bad_shape_specs(spec, message, col, width, hint):
    err = raises_spec_error(ShapeSpec.parse, spec)
    assert str(err) == expected_error(message, spec, col, width, hint)
    assert (err.message, err.spec, err.pos, err.hint) == (message, spec, col, hint)
    if spec.isascii():  # the same error for the bytes spelling
        assert str(raises_spec_error(ShapeSpec.parse, spec.encode())) == str(err)


def test_caret_is_placed_under_escaped_characters():
    # repr() shows a tab as two characters: the caret must still land under the fault.
    err = raises_spec_error(ShapeSpec.parse, "a\tb//d")
    assert str(err).splitlines() == [
        "empty mesh axis between '/' and '/'",
        r"    'a\tb//d'",
        "          ^",
        r"hint: remove the extra '/': did you mean 'a\tb/d'?",
    ]
    # A no-break space is not a separator; repr() shows it as '\xa0' (4 columns).
    err = raises_spec_error(ShapeSpec.parse, "a\xa0b")
    assert str(err).splitlines() == [
        r"non-ASCII character '\xa0' (U+00A0 NO-BREAK SPACE) in dim 'a\xa0b'",
        r"    'a\xa0b'",
        "      ^^^^",
        "hint: separate dims with ordinary ASCII spaces",
    ]
    # A spec holding a single quote is shown in double quotes.
    err = raises_spec_error(ShapeSpec.parse, "a'b")
    assert str(err).splitlines() == [
        """unexpected character "'" in dim "a'b\"""",
        """    "a'b\"""",
        "      ^",
        "hint: dims are NAME or NAME/axis/axis, separated by spaces",
    ]
    # ... and holding both quotes, repr() escapes the single quote as \' (2 columns).
    assert str(SpecError("m", "\"'ab", 3)).splitlines() == ["m", r"""    '"\'ab'""", " " * 9 + "^"]


def test_non_ascii_bytes_spec():
    err = raises_spec_error(ShapeSpec.parse, b"a b/\xff")
    assert str(err) == expected_error(
        "non-ASCII byte 0xff in a bytes spec", "a b/\ufffd", 4, 1, ASCII_HINT
    )
    err = raises_spec_error(ShapeSpec.parse, "né".encode())  # utf-8: two bytes for 'é'
    assert err.message == "non-ASCII byte 0xc3 in a bytes spec"
    assert err.pos == 1


# ---------------------------------------------------------------------------------------------
# Op-spec syntax errors (parse_op_spec)
# ---------------------------------------------------------------------------------------------

# fmt: off
BAD_OP_SYNTAX = [
    # (spec, kwargs, message after "op: ", col, width, hint)
    ("a b", {}, "missing '->': an op spec reads 'INPUT -> OUTPUT'", 3, 1,
     "write the layout before and after, e.g. 'a b/d -> a b'"),
    # a Unicode (or '=>') arrow for '->': the caret goes under it
    ("a/d → a", {}, "missing '->': '→' (U+2192 RIGHTWARDS ARROW) is not an arrow shardops "
     "reads; an op spec reads 'INPUT -> OUTPUT'", 4, 1,
     "write the arrow as ASCII '->': did you mean 'a/d -> a'?"),
    ("a b ⟶ a", {}, "missing '->': '⟶' (U+27F6 LONG RIGHTWARDS ARROW) is not an arrow "
     "shardops reads; an op spec reads 'INPUT -> OUTPUT'", 4, 1,
     "write the arrow as ASCII '->': did you mean 'a b -> a'?"),
    ("a, b ⇒ a", {}, "missing '->': '⇒' (U+21D2 RIGHTWARDS DOUBLE ARROW) is not an arrow "
     "shardops reads; an op spec reads 'INPUT -> OUTPUT'", 5, 1,
     "write the arrow as ASCII '->': did you mean 'a, b -> a'?"),
    ("a/d => a", {}, "missing '->': '=>' is not an arrow shardops reads; an op spec reads "
     "'INPUT -> OUTPUT'", 4, 2, "write the arrow as '->': did you mean 'a/d -> a'?"),
    ("a → b -> b", {}, "non-ASCII character '→' (U+2192 RIGHTWARDS ARROW) in dim '→'", 2, 1,
     "write the arrow as ASCII '->': did you mean 'a -> b -> b'?"),
    ("a -> b -> c", {}, "more than one '->' in op spec", 7, 2,
     "an op spec has one arrow: 'INPUT, INPUT -> OUTPUT'"),
    ("a, b -> a", {"n_inputs": 1}, "expected 1 input spec before '->', got 2", 0, 4,
     "this op takes one operand"),
    (" a -> a", {"n_inputs": 2}, "expected 2 input specs before '->', got 1", 1, 1,
     "separate operands with commas: 'a b, b c -> a c'"),
    ("a -> b, c", {}, "an op has exactly one output spec", 6, 1,
     "list the output dims separated by spaces after '->'"),
    ("a/d b/d -> a b", {}, TWICE, 6, 1, "remove one of the two '/d' (first used by dim 'a/d')"),
    ("a/d -> a/d/d", {}, TWICE, 11, 1, "remove one of the two '/d' (first used by dim 'a/d/d')"),
    ("a b -> a//d b", {}, "empty mesh axis between '/' and '/'", 9, 1,
     "remove the extra '/': did you mean 'a b -> a/d b'?"),
    ("[a] b -> a b", {}, "unexpected character '[' in dim '[a]'", 0, 1,
     "only index_unreduced specs bracket a dim, written as one token: '[vocab/t]'"),
    ("[V M, B -> B", {"brackets": True},
     "unclosed bracket: the looked-up dim must be written as one token '[NAME/axis]'", 0, 2,
     "close the bracket right after the dim, with no spaces inside"),
    ("[] M, B -> B M", {"brackets": True}, "empty brackets: write the looked-up dim inside them",
     0, 2, "e.g. '[vocab/t] d, batch -> batch d'"),
    ("[V] [M], B -> B", {"brackets": True},
     "more than one bracketed dim: index_unreduced looks up exactly one dim", 4, 3,
     "bracket only the dim that the indices address"),
    ("V] M, B -> B M", {"brackets": True}, "unexpected character ']' in dim 'V]'", 1, 1,
     "only index_unreduced specs bracket a dim, written as one token: '[vocab/t]'"),
    ("[V] M, B -> B [M]", {"brackets": True},
     "the output has no bracketed dim: brackets mark the looked-up dim of the table", 14, 3,
     "remove the brackets from the output"),
    ("[V/x/] M, B -> B M", {"brackets": True}, "missing mesh axis after '/'", 4, 1,
     "remove the trailing '/' or name an axis: did you mean '[V/x] M, B -> B M'?"),
]
# fmt: on


@pytest.mark.parametrize(("spec", "kwargs", "message", "col", "width", "hint"), BAD_OP_SYNTAX)
def test_bad_op_spec_syntax(spec, kwargs, message, col, width, hint):
    err = raises_spec_error(parse_op_spec, spec, op="some_op", **kwargs)
    assert str(err) == expected_error(f"some_op: {message}", spec, col, width, hint)


def test_op_spec_parse_and_render():
    ops = parse_op_spec(b"[V/t] M,\tB/d L ->  B/d L M", op="index_unreduced", brackets=True)
    assert ops.inputs == (
        ShapeSpec((D("V", ("t",)), D("M"))),
        ShapeSpec((D("B", ("d",)), D("L"))),
    )
    assert ops.output == ShapeSpec((D("B", ("d",)), D("L"), D("M")))
    assert ops.bracketed == (0, None)
    assert str(ops) == "[V/t] M, B/d L -> B/d L M"
    # Scalars on either side, and several inputs.
    ops = parse_op_spec(" -> ", op="x")
    assert (ops.inputs, ops.output) == ((ShapeSpec(()),), ShapeSpec(()))
    assert str(ops) == " -> "
    ops = parse_op_spec("a, , b ->", op="x")
    assert ops.inputs == (ShapeSpec((D("a"),)), ShapeSpec(()), ShapeSpec((D("b"),)))
    assert str(ops) == "a, , b -> "


# ---------------------------------------------------------------------------------------------
# 3. Caching
# ---------------------------------------------------------------------------------------------


def test_parsing_is_cached():
    text = "cache_probe/d len 3"
    first = ShapeSpec.parse(text)
    assert ShapeSpec.parse("cache_probe/d len 3") is first
    assert ShapeSpec.parse(text.encode()) is first  # bytes share the cache entry
    assert ShapeSpec.parse(first) is first  # an already parsed spec passes through
    assert parse_op_spec("a/d -> a", op="x") is parse_op_spec(b"a/d -> a", op="y")
    assert all_gather_recipe("a/d b -> a b") is all_gather_recipe("a/d b -> a b")
    assert einsum_recipe("a b, b -> a", 2) is einsum_recipe("a b, b -> a", 2)
    assert all_reduce_recipe("psum", "a b/d", "t") is all_reduce_recipe("psum", b"a b/d", "t")
    # Axes given as a list (unhashable) are planned each time, to the same plan.
    assert all_reduce_recipe("psum", "a", ["t", "d"]) == all_reduce_recipe("psum", "a", ("t", "d"))


def test_parsed_nodes_carry_their_spans():
    """Dims, the ``{+t}`` clause and each operand know where they were written."""
    text = " [V/t] M, B/d  L {+x+y} -> B/d L M "
    ops = parse_op_spec(text, op="x", brackets=True)
    table, idx = ops.inputs
    spans = [d.span for d in table.dims] + [d.span for d in idx.dims]
    assert [text[a:b] for a, b in spans] == ["V/t", "M", "B/d", "L"]
    assert idx.pending_span is not None
    assert text[slice(*idx.pending_span)] == "{+x+y}"
    assert [text[slice(*s.span)] for s in (table, idx, ops.output)] == [
        "[V/t] M",
        "B/d  L {+x+y}",
        "B/d L M",
    ]
    assert ops.output.pending_span is None
    shape = ShapeSpec.parse("a/d {+t}")
    assert shape.pending_span == (4, 8) and shape.dims[0].span == (0, 3)
    # Spans are not compared: a spec parsed from other text is the same spec.
    assert ShapeSpec.parse("  a/d   {+t}") == shape


def test_all_reduce_plans():
    plan = all_reduce_recipe("psum", "B/d M {+t}", "t")
    assert (plan.axes, plan.needs, plan.sums) == (("t",), ("t",), ("t",))
    assert plan.spec.inputs[0].pending == ("t",) and plan.spec.output.pending == ()
    assert plan.scope_name == "shardops.psum[B/d M {+t}]"
    assert all_reduce_recipe("pmax", "B", "d/t").sums == ()  # max and min are not sums
    with pytest.raises(SpecError, match="split over it"):
        all_reduce_recipe("psum", "B/d", "d")


def test_errors_are_not_cached_away():
    # Each failing parse raises again (a fresh error each time, same text).
    e1 = raises_spec_error(ShapeSpec.parse, "a//b")
    e2 = raises_spec_error(ShapeSpec.parse, "a//b")
    assert e1 is not e2 and str(e1) == str(e2)


# ---------------------------------------------------------------------------------------------
# 4. Property tests
# ---------------------------------------------------------------------------------------------

fuzz_text = st.one_of(
    st.lists(st.one_of(st.sampled_from(fuzz.FRAGMENTS), st.text(max_size=2)), max_size=12).map(
        "".join
    ),
    st.lists(st.sampled_from(fuzz.NEAR_VALID), max_size=8).map(" ".join),
    st.text(alphabet=fuzz.SPEC_ALPHABET, max_size=16),
    st.text(max_size=10),
)


def check_caret(err: SpecError) -> None:
    """The caret line points at ``err.spec[err.pos]`` as repr() prints it."""
    lines = str(err).split("\n")
    assert lines[0] == err.message
    if err.pos is None:
        return
    shown, caret = lines[1], lines[2]
    assert shown == f"    {err.spec!r}"
    col = caret.index("^")
    assert set(caret[col:]) == {"^"} and set(caret[:col]) <= {" "}
    # What is printed before the caret, closed with the quote, is exactly spec[:pos].
    quote = shown[4]
    assert ast.literal_eval(shown[4:col] + quote) == err.spec[: err.pos]


def check_shape_text(text: str) -> None:
    """A shape spec parses and prints back to itself, or raises SpecError with a true caret."""
    try:
        spec = ShapeSpec.parse(text)
    except SpecError as e:
        check_caret(e)
        return
    assert ShapeSpec.parse(str(spec)) == spec
    assert all(isinstance(d, DimSpec) for d in spec.dims)


def check_shape_bytes(data: bytes) -> None:
    """A bytes spec parses as its ASCII text does (the same cached spec), or raises SpecError."""
    try:
        spec = ShapeSpec.parse(data)
    except SpecError as e:
        check_caret(e)
        return
    assert spec is ShapeSpec.parse(data.decode("ascii"))


@settings(max_examples=examples(500), deadline=None)
@given(text=fuzz_text)
def test_shape_parse_fuzz(text):
    check_shape_text(text)


@settings(max_examples=examples(200), deadline=None)
@given(data=st.binary(max_size=12))
def test_bytes_parse_fuzz(data):
    check_shape_bytes(data)


PLANS = {
    "all_gather": all_gather_recipe,
    "psum_scatter": psum_scatter_recipe,
    "all_to_all": all_to_all_recipe,
    "einsum_unreduced": lambda s: einsum_recipe(s, s.split("->")[0].count(",") + 1),
    "index_unreduced": index_recipe,
}

near_operand = st.lists(st.sampled_from(fuzz.NEAR_OPERANDS), max_size=4).map(" ".join)
op_text = st.one_of(
    st.lists(near_operand, min_size=1, max_size=3)
    .map(", ".join)
    .flatmap(lambda lhs: near_operand.map(lambda rhs: f"{lhs} -> {rhs}")),
    st.tuples(fuzz_text, st.sampled_from(fuzz.ARROWS), fuzz_text).map("".join),
    st.tuples(fuzz_text, st.just(", "), fuzz_text, st.just(" -> "), fuzz_text).map("".join),
    fuzz_text,
)


def check_op_text(text: str, brackets: bool) -> None:
    """An op spec parses and prints back to itself, or raises SpecError naming the op."""
    try:
        ops = parse_op_spec(text, op="fuzz", brackets=brackets)
    except SpecError as e:
        assert e.message.startswith("fuzz: ")
        check_caret(e)
        return
    again = parse_op_spec(str(ops), op="fuzz", brackets=brackets)
    assert (again.inputs, again.output, again.bracketed) == (
        ops.inputs,
        ops.output,
        ops.bracketed,
    )


@settings(max_examples=examples(500), deadline=None)
@given(text=op_text, brackets=st.booleans())
def test_op_parse_fuzz(text, brackets):
    check_op_text(text, brackets)


# Specs that parse, so that the plans' own checks run (and must raise only SpecError).
valid_dim = st.builds(
    lambda n, ax: "/".join([n, *ax]),
    st.sampled_from(fuzz.VALID_NAMES),
    st.lists(st.sampled_from(fuzz.VALID_AXES), max_size=2, unique=True),
)
valid_operand = st.lists(valid_dim, max_size=3).map(" ".join)
plan_text = st.builds(
    fuzz.plan_spec,
    st.lists(valid_operand, min_size=1, max_size=2),
    valid_operand,
    st.integers(0, 5),
)


def check_plan_text(text: str, name: str) -> None:
    """A plan is made of a spec (its text kept) or refused with SpecError naming the op."""
    try:
        plan = PLANS[name](text)
    except SpecError as e:
        check_caret(e)
        assert e.message.startswith(f"{name}: ")
        return
    assert plan.spec.text == text


@settings(max_examples=examples(300), deadline=None)
@given(text=st.one_of(plan_text, op_text), name=st.sampled_from(sorted(PLANS)))
def test_plans_fuzz(text, name):
    check_plan_text(text, name)


# The same grammars drawn by a seeded `random.Random` (tests/_fuzz_text.py): as many inputs as
# the property tests above once drew (10,000 shapes, 10,000 op specs, 3,000 plans, 2,000 byte
# strings), in a second instead of two minutes of Hypothesis' engine; the property tests keep
# shrinking a failure to its smallest input. A failure here names its seed and input.
SEEDED_ROUNDS = {"shape": 10_000, "bytes": 2_000, "op": 10_000, "plan": 3_000}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(SEEDED_ROUNDS))
def test_seeded_fuzz(kind):
    rng = random.Random(f"test_parsing-{kind}")
    for i in range(SEEDED_ROUNDS[kind]):
        if kind == "shape":
            case: tuple = (fuzz.fuzz_text(rng),)
            check = check_shape_text
        elif kind == "bytes":
            case, check = (fuzz.binary(rng, 12),), check_shape_bytes
        elif kind == "op":
            case = (fuzz.op_text(rng), rng.random() < 0.5)
            check = check_op_text
        else:
            text = fuzz.plan_text(rng) if rng.random() < 0.5 else fuzz.op_text(rng)
            case, check = (text, rng.choice(sorted(PLANS))), check_plan_text
        try:
            check(*case)
        except Exception as e:  # noqa: BLE001  # name the input, keep the error
            raise AssertionError(f"{kind} round {i}: {case!r}") from e


identifier = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,4}", fullmatch=True)
separator = st.sampled_from([" ", "  ", "\t", " \t ", "\n"])


@st.composite
def structured_specs(draw):
    """(rendered spec, expected dims): random names/literals, disjoint mesh axes."""
    sizes = draw(st.lists(st.one_of(identifier, st.integers(0, 10**6)), max_size=6))
    axes = draw(st.lists(identifier, unique=True, max_size=6))
    sharding: list[list[str]] = [[] for _ in sizes]
    if sizes:
        for a in axes:
            k = draw(st.integers(-1, len(sizes) - 1))  # -1: axis unused
            if k >= 0:
                sharding[k].append(a)
    tokens = []
    for size, sh in zip(sizes, sharding, strict=True):
        size_text = str(size)
        if isinstance(size, int):
            size_text = "0" * draw(st.integers(0, 2)) + size_text  # leading zeros allowed
        tokens.append("/".join([size_text, *sh]))
    seps = draw(st.lists(separator, min_size=len(tokens) + 1, max_size=len(tokens) + 1))
    text = seps[0] * draw(st.booleans())
    for tok, sep in zip(tokens, seps[1:], strict=True):
        text += tok + sep
    dims = tuple(D(s, tuple(sh)) for s, sh in zip(sizes, sharding, strict=True))
    return text, dims


@pytest.mark.slow
@settings(max_examples=1_000, deadline=None)
@given(case=structured_specs(), as_bytes=st.booleans())
def test_structured_valid_specs(case, as_bytes):
    text, dims = case
    spec = ShapeSpec.parse(text.encode() if as_bytes else text)
    assert spec.dims == dims
    assert str(spec) == " ".join("/".join([str(d.shape), *d.sharding]) for d in dims)
    assert ShapeSpec.parse(str(spec)) == spec
    assert spec.partition_entries() == tuple(
        None if not d.sharding else d.sharding[0] if len(d.sharding) == 1 else d.sharding
        for d in dims
    )


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(case=structured_specs(), data=st.data())
def test_gather_and_scatter_plans_are_inverse(case, data):
    """Dropping random trailing axes: all_gather removes exactly them, psum_scatter adds them."""
    _, dims = case
    names = [f"n{i}" for i in range(len(dims))]  # distinct names keep the specs valid
    full = " ".join("/".join([n, *d.sharding]) for n, d in zip(names, dims, strict=True))
    keep = [data.draw(st.integers(0, len(d.sharding))) for d in dims]
    less = " ".join(
        "/".join([n, *d.sharding[:k]]) for n, d, k in zip(names, dims, keep, strict=True)
    )
    moved = tuple(
        (i, d.sharding[k:])
        for i, (d, k) in enumerate(zip(dims, keep, strict=True))
        if d.sharding[k:]
    )
    if not moved:
        err = raises_spec_error(all_gather_recipe, f"{full} -> {less}")
        assert "gathers nothing" in err.message
        err = raises_spec_error(psum_scatter_recipe, f"{less} -> {full}")
        assert "scatters nothing" in err.message
        return
    assert all_gather_recipe(f"{full} -> {less}").gathers == moved
    assert psum_scatter_recipe(f"{less} -> {full}").scatters == moved


# ---------------------------------------------------------------------------------------------
# 5. Op-spec plans: good specs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "gathers"),
    [
        ("in hidden/d -> in hidden", ((1, ("d",)),)),
        ("a/x/y b/z -> a/x b", ((0, ("y",)), (1, ("z",)))),
        ("B/d/t L -> B L", ((0, ("d", "t")),)),
        ("B/d/t L/x 2 -> B/d L/x 2", ((0, ("t",)),)),
    ],
)
def test_plan_all_gather(spec, gathers):
    plan = all_gather_recipe(spec)
    assert plan.gathers == gathers
    assert str(plan.spec) == spec


@pytest.mark.parametrize(
    ("spec", "scatters"),
    [
        ("B L M -> B L M/t", ((2, ("t",)),)),
        ("a/x b -> a/x/y b/z", ((0, ("y",)), (1, ("z",)))),
        ("B L -> B/d/t L", ((0, ("d", "t")),)),
    ],
)
def test_plan_psum_scatter(spec, scatters):
    assert psum_scatter_recipe(spec).scatters == scatters


@pytest.mark.parametrize(
    ("spec", "axes", "split_dim", "concat_dim"),
    [
        ("B/d L -> B L/d", ("d",), 1, 0),
        ("B L/t/d M/x -> B/t/d L M/x", ("t", "d"), 0, 1),
        ("a/x/y b/z -> a/x b/z/y", ("y",), 1, 0),
        ("a b c/q -> a/q b c", ("q",), 0, 2),
    ],
)
def test_plan_all_to_all(spec, axes, split_dim, concat_dim):
    plan = all_to_all_recipe(spec)
    assert (plan.axes, plan.split_dim, plan.concat_dim) == (axes, split_dim, concat_dim)


@pytest.mark.parametrize(
    ("spec", "n", "equation", "unreduced"),
    [
        ("B/d L M, M F/t -> B/d L F/t", 2, "abc,cd->abd", ()),
        ("B/d F/t, F/t M -> B/d M", 2, "ab,bc->ac", ("t",)),
        ("z y, y x -> x z", 2, "ab,bc->ca", ()),  # letters in first-appearance order
        ("M/t/d, M/t/d ->", 2, "a,a->", ("t", "d")),
        ("a b/t -> a", 1, "ab->a", ("t",)),
        ("a b, b c, c d -> a d", 3, "ab,bc,cd->ad", ()),
        ("a/x b/y, b/y c/z -> a/x c/z", 2, "ab,bc->ac", ("y",)),
        ("a/x b/y c/z, c/z -> ", 2, "abc,c->", ("x", "y", "z")),
        ("2 a, a -> 2", 2, "ab,b->a", ()),
    ],
)
def test_plan_einsum(spec, n, equation, unreduced):
    plan = einsum_recipe(spec, n)
    assert (plan.equation, plan.unreduced) == (equation, unreduced)


@pytest.mark.parametrize(
    ("spec", "table_dim", "axes", "shared", "perm"),
    [
        ("[V/t] M, B/d L -> B/d L M", 0, ("t",), (), (0, 1, 2)),
        ("[V] M, B L -> M B L", 0, (), (), (2, 0, 1)),
        ("E/e [V/t] M, E/e B -> E/e B M", 1, ("t",), ((0, 0),), (0, 1, 2)),
        ("E [V] M, B E -> M E B", 1, (), ((0, 1),), (2, 0, 1)),
        # computed order: shared, table dims before the bracket, index dims, dims after it
        ("L [V/x/y] M, B -> B L M", 1, ("x", "y"), (), (1, 0, 2)),
        ("[V], B -> B", 0, (), (), (0,)),
    ],
)
def test_plan_index(spec, table_dim, axes, shared, perm):
    plan = index_recipe(spec)
    assert (plan.table_dim, plan.axes, plan.shared, plan.perm) == (table_dim, axes, shared, perm)


# ---------------------------------------------------------------------------------------------
# 5. Op-spec plans: bad specs, full messages
# ---------------------------------------------------------------------------------------------

RENAME = "does not rename or reorder dims"
SAME_NAMES = "write the same dim names in the same order on both sides"
SPLIT_HINT = "split it into several all_to_all calls"

# fmt: off
BAD_PLANS = [
    # (op, spec, message, column (None: no caret), width, hint)
    # all_gather
    ("all_gather", "a b -> a/d b", "all_gather: dim 0 goes from 'a' to 'a/d', which adds sharding",
     7, 3, "all_gather only removes mesh axes; psum_scatter adds them (summing over them)"),
    ("all_gather", "a/d b -> a b/d", "all_gather: dim 1 goes from 'b' to 'b/d', which adds sharding",
     11, 3, "this moves mesh axis 'd' from dim 0 to dim 1: use all_to_all"),
    ("all_gather", "a/x/y -> a/y",
     "all_gather: dim 0 goes from 'a/x/y' to 'a/y', which does not remove trailing mesh axes",
     9, 3, "all_gather removes axes from the end: 'a/x/y -> a/x', not 'a/x/y -> a/y'"),
    ("all_gather", "a/x -> a/y", "all_gather: dim 0 goes from 'a/x' to 'a/y', which replaces mesh axes",
     7, 3, "all_gather only removes trailing mesh axes; to move an axis between dims use all_to_all"),
    ("all_gather", "a/d b -> a c", f"all_gather: dim 1 is 'b' in the input but 'c' in the output; all_gather {RENAME}",
     11, 1, SAME_NAMES),
    ("all_gather", "a/d b -> b a", f"all_gather: dim 0 is 'a' in the input but 'b' in the output; all_gather {RENAME}",
     9, 1, SAME_NAMES),
    ("all_gather", "a/d b -> a", "all_gather: input has 2 dims but output has 1; all_gather keeps the rank",
     9, 1, "all_gather only removes mesh axes: 'a/d b -> a b'"),
    ("all_gather", "a/d -> a b c", "all_gather: input has 1 dims but output has 3; all_gather keeps the rank",
     7, 5, "all_gather only removes mesh axes: 'a/d b -> a b'"),
    ("all_gather", "a b/d -> a b/d", "all_gather: the spec gathers nothing (input and output layouts are equal)",
     None, 1, "remove the call, or remove a '/axis' from the output"),
    ("all_gather", "a/d, b -> a", "all_gather: expected 1 input spec before '->', got 2",
     0, 6, "this op takes one operand"),
    # psum_scatter
    ("psum_scatter", "a/d b -> a b", "psum_scatter: dim 0 goes from 'a/d' to 'a', which removes sharding",
     9, 1, "psum_scatter only adds mesh axes; all_gather removes them"),
    ("psum_scatter", "a b/d -> a/d b", "psum_scatter: dim 1 goes from 'b/d' to 'b', which removes sharding",
     13, 1, "this moves mesh axis 'd' from dim 1 to dim 0: use all_to_all"),
    ("psum_scatter", "a/x -> a/y/x",
     "psum_scatter: dim 0 goes from 'a/x' to 'a/y/x', which does not add trailing mesh axes",
     7, 5, "psum_scatter adds axes at the end: 'a/x -> a/x/y', not 'a/x -> a/y/x'"),
    ("psum_scatter", "a/x -> a/y", "psum_scatter: dim 0 goes from 'a/x' to 'a/y', which replaces mesh axes",
     7, 3, "psum_scatter only adds trailing mesh axes; to move an axis between dims use all_to_all"),
    ("psum_scatter", "a b -> a b", "psum_scatter: the spec scatters nothing (input and output layouts are equal)",
     None, 1, "to sum without scattering use psum('a b', x, axes=...)"),
    ("psum_scatter", "a b -> a b/t c", "psum_scatter: input has 2 dims but output has 3; psum_scatter keeps the rank",
     7, 7, "psum_scatter only adds mesh axes: 'a b -> a/d b'"),
    ("psum_scatter", "a b -> a/t c", f"psum_scatter: dim 1 is 'b' in the input but 'c' in the output; psum_scatter {RENAME}",
     11, 1, SAME_NAMES),
    # all_to_all
    ("all_to_all", "a b -> a b", "all_to_all: the spec moves nothing (input and output layouts are equal)",
     None, 1, "all_to_all moves mesh axes from one dim to another, e.g. 'a/d b -> a b/d'"),
    ("all_to_all", "a/d b -> a b", "all_to_all: dim 0 loses 'd' but no dim gains it; removing sharding is all_gather",
     9, 1, "use all_gather, or append the axis to another dim: 'a/d b -> a b/d'"),
    ("all_to_all", "a b -> a b/d", "all_to_all: dim 1 gains 'd' but no dim loses it; adding sharding is psum_scatter",
     9, 3, "use psum_scatter, or take the axis from another dim: 'a/d b -> a b/d'"),
    ("all_to_all", "a/d b/t c -> a b c/d/t",
     "all_to_all: dims 0 and 1 both lose mesh axes; all_to_all moves axes out of one dim into one other dim",
     15, 1, SPLIT_HINT),
    ("all_to_all", "a/d/t b c -> a b/t c/d",
     "all_to_all: dims 1 and 2 both gain mesh axes; all_to_all moves axes out of one dim into one other dim",
     19, 3, SPLIT_HINT),
    ("all_to_all", "a/d/t b -> a b/t/d",
     "all_to_all: dim 0 loses 'd/t' but dim 1 gains 't/d'; the same axes must move",
     13, 5, None),
    ("all_to_all", "a/d b/t -> a/t b/d",
     "all_to_all: dim 0 goes from 'a/d' to 'a/t'; all_to_all removes trailing axes from one dim "
     "and appends them to another", 11, 3, None),
    ("all_to_all", "a/d b -> b a/d", f"all_to_all: dim 0 is 'a' in the input but 'b' in the output; all_to_all {RENAME}",
     9, 1, SAME_NAMES),
    ("all_to_all", "a/d b -> a b/d c", "all_to_all: input has 2 dims but output has 3; all_to_all keeps the rank",
     9, 7, "all_to_all moves a mesh axis between dims: 'a/d b -> a b/d'"),
    # einsum_unreduced
    ("einsum_unreduced", "a b, b c -> a d", "einsum_unreduced: output dim 'd' does not appear in any input",
     14, 1, "inputs have 'a', 'b', 'c'"),
    ("einsum_unreduced", "a b/d, b c -> a c",
     "einsum_unreduced: dim 'b' is 'b/d' in operand 0 but 'b' in operand 1; a dim shared by "
     "operands must be split the same way", 7, 1, "all_gather or psum_scatter one operand first"),
    ("einsum_unreduced", "a b/d, b/t c -> a c",
     "einsum_unreduced: dim 'b' is 'b/d' in operand 0 but 'b/t' in operand 1; a dim shared by "
     "operands must be split the same way", 7, 3, "all_gather or psum_scatter one operand first"),
    ("einsum_unreduced", "a/d b -> a/d b/t",
     "einsum_unreduced: output dim 'b/t' is split differently from input dim 'b'; a local einsum "
     "cannot change a layout", 13, 3,
     "change the layout afterwards with all_gather/psum_scatter/all_to_all"),
    ("einsum_unreduced", "a/d, b/d -> a/d",
     "einsum_unreduced: mesh axis 'd' splits dim 'a/d' in operand 0 and dim 'b/d' in operand 1; "
     "the local einsum would pair blocks of different dims", 5, 3,
     "all_gather one of them first, or split them over different mesh axes"),
    ("einsum_unreduced", "a a -> a",
     "einsum_unreduced: dim 'a' appears twice in operand 0; traces and diagonals are not supported",
     2, 1, "a square operand (a weight a x a) takes two names of the same size: write its second "
     "dim as another name, such as 'a2', and use that name where the einsum means that dim"),
    ("einsum_unreduced", "a b, b -> a a", "einsum_unreduced: output dim 'a' appears twice", 12, 1, None),
    # index_unreduced
    ("index_unreduced", "V M, B -> B M",
     "index_unreduced: the table spec needs one bracketed dim, the one the indices address",
     0, 3, "write e.g. '[vocab/t] d, batch len -> batch len d'"),
    ("index_unreduced", "[V] [M], B -> B",
     "index_unreduced: more than one bracketed dim: index_unreduced looks up exactly one dim",
     4, 3, "bracket only the dim that the indices address"),
    ("index_unreduced", "[V] M, [B] -> B M",
     "index_unreduced: only the table (first operand) has a bracketed dim", 8, 1,
     "remove the brackets from the indices; bracket the table dim they address"),
    ("index_unreduced", "V M, [B/d] -> B/d M",
     "index_unreduced: only the table (first operand) has a bracketed dim", 6, 3,
     "remove the brackets from the indices; bracket the table dim they address"),
    ("index_unreduced", "[V] M, B V -> B M",
     "index_unreduced: the looked-up dim 'V' also appears in the indices", 9, 1,
     "the indices address the bracketed dim; give the index dims other names"),
    ("index_unreduced", "[V/t] M, B/t -> B/t M",
     "index_unreduced: mesh axis 't' splits both the looked-up dim 'V/t' and index dim 'B/t'; "
     "the result is summed over 't' afterwards, which would add up different blocks of 'B'",
     9, 3, "all_gather the indices over 't' first, or split the table over another mesh axis"),
    ("index_unreduced", "E/e [V] M, E B -> E B M",
     "index_unreduced: dim 'E' is 'E/e' in the table but 'E' in the indices; a dim shared by "
     "both must be split the same way", 11, 1, "all_gather or psum_scatter one operand first"),
    ("index_unreduced", "[V] M M, B -> B M M",
     "index_unreduced: dim 'M' appears twice in the table", 6, 1,
     "give each dim of an operand its own name"),
    ("index_unreduced", "[V] M, B B -> B B M",
     "index_unreduced: dim 'B' appears twice in the indices", 9, 1,
     "give each dim of an operand its own name"),
    ("index_unreduced", "[V] M, B -> B",
     "index_unreduced: the output must have every non-bracketed table dim and every index dim, "
     "once each; missing ['M']", 12, 1, "e.g. '[V] M, B -> B M'"),
    ("index_unreduced", "[V] M, B -> B M V",
     "index_unreduced: the output must have every non-bracketed table dim and every index dim, "
     "once each; unexpected ['V']", 16, 1, "e.g. '[V] M, B -> B M'"),
    ("index_unreduced", "[V] M/x, B -> B M",
     "index_unreduced: output dim 'M' must keep the input's layout 'M/x'", 16, 1, None),
    ("index_unreduced", "[V] M, B -> [B] M",
     "index_unreduced: the output has no bracketed dim: brackets mark the looked-up dim of the "
     "table", 12, 3, "remove the brackets from the output"),
]
# fmt: on


@pytest.mark.parametrize(("op", "spec", "message", "col", "width", "hint"), BAD_PLANS)
def test_bad_plans(op, spec, message, col, width, hint):
    err = raises_spec_error(PLANS[op], spec)
    assert str(err) == expected_error(message, spec, col, width, hint)


def test_einsum_operand_count_must_match():
    err = raises_spec_error(einsum_recipe, "a b, b c -> a c", 3)
    assert str(err) == expected_error(
        "einsum_unreduced: expected 3 input specs before '->', got 2",
        "a b, b c -> a c",
        0,
        8,
        "separate operands with commas: 'a b, b c -> a c'",
    )


def test_op_spec_error_helpers():
    ops = parse_op_spec("[V/t] M, B/d L -> B/d L M", op="x", brackets=True)
    assert isinstance(ops, OpSpec)
    # dim carets: inside brackets, and the width of the written token
    assert str(ops.error("m", operand=0, dim=0)).splitlines()[2] == " " * 6 + "^^^"
    assert str(ops.error("m", operand=1, dim=1)).splitlines()[2] == " " * 18 + "^"
    assert str(ops.error("m", operand=None, dim=2)).splitlines()[2] == " " * 29 + "^"
    # dim=None: the whole operand, or the whole output
    assert str(ops.error("m", operand=1, dim=None)).splitlines()[2] == " " * 14 + "^" * 5
    assert str(ops.error("m", operand=None, dim=None)).splitlines()[2] == " " * 23 + "^" * 7
    assert str(ops.spec_error("m", hint="h")) == "m\n    '[V/t] M, B/d L -> B/d L M'\nhint: h"


@pytest.mark.parametrize(
    ("axes", "parsed"),
    [("d", ("d",)), ("d/t", ("d", "t")), (" d  t ", ("d", "t")), (("x", "y"), ("x", "y"))],
)
def test_parse_axes(axes, parsed):
    assert parse_axes(axes, "psum") == parsed


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        ("", "psum: name at least one mesh axis to reduce over"),
        ((), "psum: name at least one mesh axis to reduce over"),
        ("d 1", "psum: '1' is not a mesh axis name"),
        ("é", "psum: 'é' is not a mesh axis name"),
        (("d", 3), "psum: 3 is not a mesh axis name"),
        ("d/d", "psum: a mesh axis is named twice in axes='d/d'"),
    ],
)
def test_parse_axes_errors(axes, message):
    err = raises_spec_error(parse_axes, axes, "psum")
    assert err.message == message


def test_parse_axes_refuses_what_is_not_a_name():
    """Not a str, tuple or list: a TypeError naming the op, its spec, the argument and the
    type (not Python's "'int' object is not iterable")."""
    hint = "expected a str such as 'd' or 'd/t', or a tuple of str such as ('d', 't')"
    for axes, got in ((0, "int"), (None, "NoneType"), ({"d"}, "set"), (b"d", "bytes")):
        with pytest.raises(TypeError) as info:
            parse_axes(axes, "psum", "B M")
        assert str(info.value) == (
            f"psum('B M'): axes={axes!r} does not name mesh axes: {hint}, got {got}"
        )
    with pytest.raises(TypeError, match=r"^axis_size: name=3 does not name mesh axes"):
        parse_axes(3, "axis_size", arg="name")
    # With the spec, SpecErrors name it too.
    err = raises_spec_error(parse_axes, ("d", 3), "pmean", "a b")
    assert err.message == "pmean('a b'): 3 is not a mesh axis name"


# ---------------------------------------------------------------------------------------------
# Pending clauses belong in shardops specs, not in annotations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "pending", "reduced"),
    [("B M {+d}", ("d",), ()), ("{+t+d}", ("t", "d"), ()), ("a/x  {+y=z}", ("y",), ("z",))],
)
def test_annotation_spec_takes_the_clause_as_jax_type(spec, pending, reduced):
    """An annotation's clause is the value's JAX type: unreduced ('{+t}') or reduced ('{=t}')
    over those axes (tests/test_jax_types.py runs it); array types keep it."""
    from shardlib._check.types import array_type
    from shardlib._lang.parsing import parse_annotation_spec
    from shardlib.shardtypes import bf16

    parsed = parse_annotation_spec(spec, what="f32[...]")
    assert (parsed.pending, parsed.reduced) == (pending, reduced)
    for written in (spec, spec.encode()):
        assert bf16.__getitem__(written).spec == parsed
    assert array_type("f32", parsed).spec == parsed
    assert parse_annotation_spec("a/d b", what="x") == ShapeSpec.parse("a/d b")
