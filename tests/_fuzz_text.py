"""The spec-language fuzz grammars, for Hypothesis and for a seeded `random.Random`.

`tests/test_parsing.py` builds its Hypothesis strategies from the constants here, and draws
the same grammars with the functions here for its seeded rounds: Hypothesis' engine costs
milliseconds an input, a seeded draw microseconds, so the tens of thousands of inputs the
parser is fuzzed with are drawn here and the property tests keep what Hypothesis is for
(shrinking a failure to its smallest input).
"""

from __future__ import annotations

import random
import string

# fmt: off
# Pieces of specs and of what a user might mistype into one.
FRAGMENTS = [
    "a", "b", "Z", "in", "_x", "x1", "0", "12", "007", "/", "//", " ", "  ", "\t", ",", "-",
    ">", "->", "[", "]", ".", "'", '"', "\\", "é", "\xa0", "\n", "{", "}", "+", "=", "{+x}",
    "{=y}", "{+x=y}",
]
# fmt: on
# Dims that are valid alone or nearly so, joined by spaces.
NEAR_VALID = [
    "a",
    "b/x",
    "c/y/z",
    "2",
    "0/w",
    "in",
    "_q/x",
    "/",
    "x",
    " ",
    "\t",
    ",",
    "{+x}",
    "{=y}",
]
# The characters of the spec language and a few letters.
SPEC_ALPHABET = string.ascii_letters[:6] + "_0123/ ,->[].{}+="
# Operands of op specs: valid, bracketed, and broken ones.
NEAR_OPERANDS = ["a", "b/x", "c/y/z", "2", "[a]", "[b/x]", "d/", "[c"]
ARROWS = ["->", " -> ", ",", ", "]
# Valid dims of the plans' specs: a name or size, split over up to two distinct mesh axes.
VALID_NAMES = ["a", "b", "c", "2"]
VALID_AXES = ["x", "y", "z"]


def maybe_bracket(operand: str, k: int) -> str:
    """``operand`` with its ``k % len``-th dim bracketed (a contracted or indexed dim)."""
    dims = operand.split()
    if dims:
        dims[k % len(dims)] = f"[{dims[k % len(dims)]}]"
    return " ".join(dims)


def plan_spec(ins: list[str], out: str, k: int) -> str:
    """An op spec of valid operands, bracketing a dim of each input when ``k % 3 == 0``."""
    return ", ".join(maybe_bracket(s, k) if k % 3 == 0 else s for s in ins) + " -> " + out


# ---------------------------------------------------------------- seeded draws


def _char(rng: random.Random) -> str:
    """Any code point but a surrogate, weighted toward ASCII as Hypothesis' text is."""
    r = rng.random()
    if r < 0.6:
        return chr(rng.randrange(0x20, 0x7F))
    if r < 0.7:
        return chr(rng.randrange(0, 0x20))
    if r < 0.85:
        return chr(rng.randrange(0x80, 0x800))
    c = rng.randrange(0x800, 0x110000 - 0x800)
    return chr(c + 0x800 if c >= 0xD800 else c)  # skip the surrogates D800-DFFF


def text(rng: random.Random, max_size: int, alphabet: str | None = None) -> str:
    n = rng.randint(0, max_size)
    if alphabet is not None:
        return "".join(rng.choice(alphabet) for _ in range(n))
    return "".join(_char(rng) for _ in range(n))


def binary(rng: random.Random, max_size: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randint(0, max_size)))


def fuzz_text(rng: random.Random) -> str:
    """One of: fragments and short random text run together; near-valid dims joined by
    spaces; a string of spec characters; any short text."""
    kind = rng.randrange(4)
    if kind == 0:
        parts = [
            rng.choice(FRAGMENTS) if rng.random() < 0.5 else text(rng, 2)
            for _ in range(rng.randint(0, 12))
        ]
        return "".join(parts)
    if kind == 1:
        return " ".join(rng.choice(NEAR_VALID) for _ in range(rng.randint(0, 8)))
    if kind == 2:
        return text(rng, 16, SPEC_ALPHABET)
    return text(rng, 10)


def _near_operand(rng: random.Random) -> str:
    return " ".join(rng.choice(NEAR_OPERANDS) for _ in range(rng.randint(0, 4)))


def op_text(rng: random.Random) -> str:
    """One of: near-valid operands around an arrow; two fuzz texts around an arrow or comma;
    three fuzz texts in the shape ``x, y -> z``; a fuzz text."""
    kind = rng.randrange(4)
    if kind == 0:
        lhs = ", ".join(_near_operand(rng) for _ in range(rng.randint(1, 3)))
        return f"{lhs} -> {_near_operand(rng)}"
    if kind == 1:
        return fuzz_text(rng) + rng.choice(ARROWS) + fuzz_text(rng)
    if kind == 2:
        return f"{fuzz_text(rng)}, {fuzz_text(rng)} -> {fuzz_text(rng)}"
    return fuzz_text(rng)


def _valid_operand(rng: random.Random) -> str:
    dims = []
    for _ in range(rng.randint(0, 3)):
        axes = rng.sample(VALID_AXES, rng.randint(0, 2))
        dims.append("/".join([rng.choice(VALID_NAMES), *axes]))
    return " ".join(dims)


def plan_text(rng: random.Random) -> str:
    """A spec of valid operands (one or two inputs), so that the plans' own checks run."""
    ins = [_valid_operand(rng) for _ in range(rng.randint(1, 2))]
    return plan_spec(ins, _valid_operand(rng), rng.randint(0, 5))
