"""The legs of CI, one nox session each: ``nox -s NAME`` runs that leg here as `.ci/run` does.

``nox -l`` lists them. Each session makes a fresh venv (with uv when it is installed, else
virtualenv) and installs shardlib in it, so a leg needs nothing but ``pip install nox uv``::

    nox -s tests-3.11      # the README's fast suite, Python 3.11 (pip picks JAX 0.10.2)
    nox -s slow            # the slow tier but the JAX-version files', Python 3.11, JAX 0.10.2
    nox -s tests-3.12      # the fast tier and the JAX-version files' slow tier, the newest JAX
    nox -s minjax          # the lowest JAX (MIN_JAX) on the JAX-version files, both tiers
    nox -s lint            # ruff, ruff format --check, pyright
    nox -s docs            # mkdocs build --strict
    nox -s wheel           # sdist + wheel, installed and imported outside the checkout

Arguments after ``--`` go to pytest: ``nox -s tests-3.12 -- tests/test_pipeline.py -x``. The
legs' own pytest runs let an idle worker take queued tests from a busy one (``--dist
worksteal``): the slow tier's few long tests no longer leave a core idle at its end.
`.ci/run` runs the README's own command first (pip, as a user would), then these sessions.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nox

# Lowest supported jax/jaxlib. Keep in sync with the `jax>=` / `jaxlib>=` bounds in
# pyproject.toml. 0.9.0 is the first release whose jax.make_mesh creates Explicit axes by
# default (and the first with no DeprecationWarning for it).
MIN_JAX = "0.9.0"


# The test files whose outcome can change with JAX's version (tests/_tiers.py says which and
# why; tests/conftest.py marks their tests `jax_version`). Every JAX that CI tests runs them,
# both tiers; the other files' slow tier runs once, on the JAX the README's command installs.
# The noxfile reads the list as text: importing tests/ would import its conftest's JAX setup.
def _version_files() -> list[str]:
    namespace: dict = {}
    exec((Path(__file__).parent / "tests" / "_tiers.py").read_text(), namespace)
    return list(namespace["JAX_VERSION_FILES"])


JAX_VERSION_FILES = _version_files()
# The pytest selections of the two halves of the slow tier.
VERSION_TIERS = ["--runslow", "-m", "not slow or jax_version"]  # fast tier + version slow tier
OTHER_SLOW = ["--runslow", "-m", "slow and not jax_version"]
PYTEST_ARGS = ["-n", "auto", "--dist", "worksteal", "--durations=20"]

LINT_DIRS = ["shardlib", "jax_extra", "tests", "benchmarks", "examples", "noxfile.py", ".ci"]

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests-3.11", "tests-3.12", "slow", "minjax", "lint", "docs", "wheel"]
# Never fetch an interpreter: a leg runs on the Pythons this machine has.
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")


def _pyenv_versions() -> None:
    """Let pyenv's ``python3.X`` shims answer for every installed release version.

    pyenv's shim for ``python3.12`` fails unless a selected version is a 3.12, so nox would not
    find the interpreters pyenv has; naming them all in PYENV_VERSION, after the versions
    already selected (so plain ``python3`` keeps its meaning), makes each shim work.
    """
    if shutil.which("pyenv") is None:
        return
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=True)
        current = subprocess.run(["pyenv", "version-name"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return
    versions = sorted(
        (
            p.name
            for p in (Path(root.stdout.strip()) / "versions").glob("3.*")
            if p.name.replace(".", "").isdigit()
        ),
        key=lambda v: tuple(int(x) for x in v.split(".")),
    )
    selected = os.environ.get("PYENV_VERSION") or current.stdout.strip()
    first = [v for v in selected.split(":") if v]
    if versions:
        os.environ["PYENV_VERSION"] = ":".join(first + [v for v in versions if v not in first])


_pyenv_versions()


def _install(session: nox.Session, *pins: str, require_jax: str | None = None) -> None:
    """shardlib with its test extra (and ``pins``); print what the installer picked."""
    session.install("-e", ".[test]", *pins)
    check = [f"--require-jax={require_jax}"] if require_jax else []
    session.run("python", ".ci/versions.py", *check)


@nox.session(python=["3.11", "3.12"])
def tests(session: nox.Session) -> None:
    """The fast suite; on 3.12 (the newest JAX) also the slow tier of `JAX_VERSION_FILES`."""
    _install(session)
    args = session.posargs or PYTEST_ARGS
    if session.python == "3.12" and not session.posargs:
        args = [*args, *VERSION_TIERS]
    session.run("pytest", *args)


@nox.session(python="3.11")
def slow(session: nox.Session) -> None:
    """The slow tier of every file but `JAX_VERSION_FILES`, on the README's Python and JAX.

    `.ci/run` runs the same pytest in the venv of the README's command (step 2b) instead of
    installing it again."""
    _install(session)
    session.run("pytest", *(session.posargs or [*PYTEST_ARGS, *OTHER_SLOW]))


@nox.session(python="3.11")
def minjax(session: nox.Session) -> None:
    """JAX ``MIN_JAX`` on `JAX_VERSION_FILES`, both tiers."""
    _install(session, f"jax=={MIN_JAX}", f"jaxlib=={MIN_JAX}", require_jax=MIN_JAX)
    args = session.posargs or [
        "-n",
        "auto",
        "--dist",
        "worksteal",
        "--runslow",
        "--durations=10",
        *JAX_VERSION_FILES,
    ]
    session.run("pytest", *args)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff (lint and format) and pyright, against Python 3.11 and the JAX it gets."""
    session.install("-e", ".[dev]")
    session.run("ruff", "check", *LINT_DIRS)
    session.run("ruff", "format", "--check", *LINT_DIRS)
    session.run(
        "pyright", "--pythonpath", str(Path(session.virtualenv.location) / "bin" / "python")
    )


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """The mkdocs site, strict: every link and every API reference resolves."""
    session.install("-e", ".[docs]")
    site = session.create_tmp()
    session.run("mkdocs", "build", "--strict", "--site-dir", site)


@nox.session(python="3.11")
def wheel(session: nox.Session) -> None:
    """Build the sdist and the wheel; install the wheel alone in a fresh venv; import it all."""
    session.install("build")
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--sdist", "--wheel", "--outdir", str(dist), ".")
    session.run("python", ".ci/check_dist.py", str(dist))
