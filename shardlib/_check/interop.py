"""Interop with jaxtyping: read ``Float32[Array, 'b d']`` as shardlib's ``f32[Array, 'b d']``.

`from_jaxtyping` turns a jaxtyping array annotation into the replicated shardlib type with the
same dtype and dims (its names bind in the same scope as shardlib's), or says why it cannot.
jaxtyping is never imported here: an annotation can only be a jaxtyping type if the user's
code imported jaxtyping already.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .._lang.parsing import ShapeSpec
from .types import DTYPES, ArrayType, array_type

__all__ = ["from_jaxtyping", "is_jaxtyping_array"]

_SHARDLIB_DTYPE_NAMES = {np.dtype(dt).name: short for short, dt in DTYPES.items()}
_SHARDLIB_DTYPE_NAMES["bool_"] = "bool_"
# Suggested first when a dtype family allows several.
_COMMON = ("float32", "bfloat16", "float16", "float64", "int32", "int64", "int8", "int16")


def is_jaxtyping_array(t: Any) -> bool:
    """Whether ``t`` is a jaxtyping array annotation such as ``Float32[Array, 'b d']``."""
    jt = sys.modules.get("jaxtyping")
    abstract = getattr(jt, "AbstractArray", None) if jt is not None else None
    return abstract is not None and isinstance(t, type) and issubclass(t, abstract)


def _dtype(t: Any, written: str, spec_text: str) -> str:
    """The shardlib short name of ``t``'s one dtype; TypeError naming the choices otherwise."""
    dtypes = getattr(t, "dtypes", None)
    names = [d for d in dtypes if isinstance(d, str)] if isinstance(dtypes, list | tuple) else []
    shorts = {_SHARDLIB_DTYPE_NAMES.get(n) for n in names}
    if len(shorts) == 1 and None not in shorts:  # one dtype (Bool lists 'bool' and 'bool_')
        return shorts.pop()  # type: ignore[return-value]
    common = [_SHARDLIB_DTYPE_NAMES[n] for n in _COMMON if n in names]
    rest = [_SHARDLIB_DTYPE_NAMES[n] for n in names if n in _SHARDLIB_DTYPE_NAMES]
    choices = list(dict.fromkeys(common + rest))
    if len(choices) > 1:
        options = " or ".join(f"{c}[Array, b{spec_text!r}]" for c in choices[:4])
        why = (
            f"allows several dtypes ({', '.join(names)}); shardlib types name one: write {options}"
        )
    elif not names:
        why = f"allows any dtype; shardlib types name one: write e.g. f32[Array, b{spec_text!r}]"
    else:
        why = f"has dtype {', '.join(names)}, which shardlib has no type for"
    raise TypeError(f"{written} {why}")


def _spec_text(t: Any, written: str) -> str:
    """jaxtyping's dims as a shardlib spec (names and sizes only); TypeError otherwise."""
    text = str(getattr(t, "dim_str", ""))
    out: list[str] = []
    for token in text.replace(",", " ").split():
        plain = token.isascii() and (token.isdigit() or token.isidentifier())
        if plain and not token.startswith("_"):
            out.append(token)
            continue
        if token.startswith("*") or token == "...":
            why = "a variadic dim (shardlib specs list every dim)"
        elif token.startswith("#"):
            why = "a broadcastable dim (shardlib dims match their size exactly)"
        elif token.startswith("_") or token.startswith("?"):
            why = "an unchecked dim (every shardlib dim is a name or a size)"
        else:
            why = "a symbolic or annotated dim (shardlib dims are names or sizes)"
        raise TypeError(
            f"{written}: dim {token!r} is {why}; write the parameter as a shardlib type, e.g. "
            f"f32[Array, 'batch len'], naming every dim"
        )
    return " ".join(out)


def from_jaxtyping(t: Any) -> type[ArrayType] | None:
    """The replicated shardlib type of jaxtyping annotation ``t``; None if ``t`` is not one.

    ``Float32[Array, 'b d']`` gives ``f32['b d']`` (the same dims, replicated: no mesh axis),
    whose names bind in the scope of the other annotations. Dtype families (``Float``,
    ``Shaped``), variadic (``*b``, ``...``), broadcastable (``#b``), anonymous (``_``) and
    symbolic dims have no shardlib equivalent.

    **Raises:** ``TypeError`` naming the annotation, what cannot be converted and the
    shardlib type to write instead.

    Examples:
        >>> from_jaxtyping(Float32[Array, 'b d'])
        f32['b d']
        >>> from_jaxtyping(f32[Array, 'b d']) is None
        True
    """
    if not is_jaxtyping_array(t):
        return None
    written = f"the jaxtyping annotation {getattr(t, '__name__', repr(t))}"
    spec_text = _spec_text(t, written)
    short = _dtype(t, written, spec_text)
    return array_type(short, ShapeSpec.parse(spec_text))
