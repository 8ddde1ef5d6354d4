"""Print the interpreter and the versions the installer picked; check both packages import.

``python .ci/versions.py --require-jax=0.9.0`` also fails unless jax and jaxlib are that version.
"""

import argparse
import importlib.metadata as md
import sys

import jax
import jaxlib
import numpy

import jax_extra  # noqa: F401
import shardlib  # noqa: F401

parser = argparse.ArgumentParser()
parser.add_argument("--require-jax", default=None)
args = parser.parse_args()
print(
    "python",
    sys.version.split()[0],
    "| jax",
    jax.__version__,
    "| jaxlib",
    jaxlib.__version__,
    "| numpy",
    numpy.__version__,
    "| orbax-checkpoint",
    md.version("orbax-checkpoint"),
    "| optax",
    md.version("optax"),
)
if args.require_jax and (jax.__version__, jaxlib.__version__) != (args.require_jax,) * 2:
    sys.exit(
        f"expected jax and jaxlib {args.require_jax}, got {jax.__version__} / {jaxlib.__version__}"
    )
