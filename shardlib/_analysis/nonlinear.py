"""The primitives the partial-sum analysis knows to be not linear: refused on a partial sum.

A primitive with no rule in `shardlib._analysis.rules` (or `rules_select`, `rules_permute`)
and no body to follow is refused when an operand is a partial sum ("is not linear (or not
known to be)"), and computed as JAX computes it otherwise. The primitives listed here get
that treatment *by decision*: their results are not linear in their operands taken together
(non-linear maths, comparisons, integer and bit operations, reductions and scans other than
sums, sorting, random bits, matrix factorisations and solves), or they take no array that
could be a partial sum (an ``iota``, an uninitialised buffer, a token). A few are linear in
one operand (``triangular_solve`` in its right-hand side, ``polynomial`` in its
coefficients) but have no rule: reduce first.

A primitive in neither table is one the analysis has not judged: the same refusal, but the
test ``tests/test_primitive_coverage.py`` lists it, per JAX version, so that a new JAX's new
primitives show at once (JAX 0.12 added ``unstack``, which iterating over an array emits,
and ``polynomial``, ``log2`` and ``one_minus_square``, which ``jnp`` functions emit).
Names across JAX 0.9 to 0.12.
"""

from __future__ import annotations

__all__ = ["NOT_LINEAR"]

_MATHS = """
    abs acos acosh asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp cos cosh
    digamma erf erf_inv erfc exp exp2 expm1 floor igamma igamma_grad_a igammac integer_pow
    is_finite lgamma log log1p log2 logistic max min nextafter one_minus_square polygamma
    polynomial pow regularized_incomplete_beta rem round rsqrt sign sin sinh sqrt square tan
    tanh zeta
"""
_COMPARISONS_AND_BITS = """
    eq eq_to ge gt le le_to lt lt_to ne and or not xor clz population_count shift_left
    shift_right_arithmetic shift_right_logical mulhi bitcast_convert_type
"""
# Reductions and scans other than sums; sorting and selecting by value.
_ORDER = """
    reduce_and reduce_max reduce_min reduce_or reduce_prod reduce_xor reduce_window_max
    reduce_window_min cumlogsumexp cummax cummin cumprod argmax argmin scatter-max scatter-min
    sort top_k approx_top_k
"""
_LINEAR_ALGEBRA = """
    cholesky cholesky_update eig eigh hessenberg householder_product lu
    lu_pivots_to_permutation qr schur svd triangular_solve tridiagonal tridiagonal_solve
    geqrf geqp3 ormqr symmetric_product
"""
_RANDOM = """
    random_bits random_fold_in random_gamma random_seed random_split random_wrap random_unwrap
    random_clone rng_bit_generator rng_uniform threefry2x32 threefry4x32 philox2x32 philox4x32
    iota_2x32_shape
"""
# Values made from no array operand (shapes, a platform, a token, uninitialised memory).
_NO_DATA = """
    iota empty empty2 create_token after_all platform_index dimension_size dim_as_value
"""

NOT_LINEAR: frozenset[str] = frozenset(
    " ".join((_MATHS, _COMPARISONS_AND_BITS, _ORDER, _LINEAR_ALGEBRA, _RANDOM, _NO_DATA)).split()
)
