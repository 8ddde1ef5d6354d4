"""Architecture rules that a reader can rely on, checked on the source of ``shardlib/``."""

from __future__ import annotations

import ast
from pathlib import Path

SHARDLIB = Path(__file__).resolve().parent.parent / "shardlib"


def _sources() -> dict[str, str]:
    """Every module of the package, by its path under ``shardlib/`` (``_env/frames.py``)."""
    return {
        p.relative_to(SHARDLIB).as_posix(): p.read_text() for p in sorted(SHARDLIB.rglob("*.py"))
    }


def test_no_source_parsing_and_frames_read_in_one_module() -> None:
    """shardlib never reads source text; only ``_env/frames.py`` reads Python frames."""
    parsing = [
        f"{name}: {word}"
        for name, text in _sources().items()
        for word in ("inspect.getsource", "ast.parse")
        if word in text
    ]
    assert not parsing, f"source parsing in shardlib: {parsing}"
    frames = [
        f"{name}: {word}"
        for name, text in _sources().items()
        if name != "_env/frames.py"
        for word in ("sys._getframe", "f_back", "currentframe")
        if word in text
    ]
    assert not frames, f"frame access outside shardlib/_env/frames.py: {frames}"


ADAPTER = "_env/programs.py"


def _param_reads(text: str) -> list[str]:
    """The places in ``text`` that read a JAX equation's parameters, a closed jaxpr's parts or
    a ``ClosedJaxpr`` type: what only the adapter ``shardlib/_env/programs.py`` may do."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr == "params":
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("eqn", "e", "q", "eq", "equation"):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name == "ClosedJaxpr":
                found.append(f"line {node.lineno}: ClosedJaxpr")
    return found


def test_jax_programs_are_read_only_through_the_adapter() -> None:
    """No module but ``_env/programs.py`` reads an equation's parameters or tells a closed
    jaxpr from an open one (JAX changes both from release to release)."""
    reads = [
        f"{name}: {r}"
        for name, text in _sources().items()
        if name != ADAPTER
        for r in _param_reads(text)
    ]
    assert not reads, f"JAX program parts read outside shardlib/{ADAPTER}: {reads}"
    # The check sees the reads it is for (so it cannot pass vacuously).
    assert _param_reads("n = eqn.params['num_consts']\nfrom x import ClosedJaxpr")
    assert _param_reads(_sources()[ADAPTER])


# Size: modules cut where the ideas part, not at a line count (the house style: JAX's
# ``shard_map.py`` is one transform in two thousand lines). A module holds one idea, named in
# its docstring's first line; that is the rule, and a reviewer's call. The line cap below is
# only a smoke alarm for a module that has grown several ideas unnoticed, set well above any
# module of one idea; a function still fits on a screen.
MAX_MODULE_LINES = 900
MAX_FUNCTION_LINES = 60
# Modules and functions allowed over the limits, each with the reason. Keep this short.
OVER_LIMITS: dict[str, str] = {}
PACKAGES = ("shardlib", "jax_extra", "benchmarks")


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``node``'s code, its docstring excluded (docstrings are examples and prose)."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if not body:
        return 0
    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    doc = node.body[0] if body is not node.body else None
    doc_lines = (doc.end_lineno - doc.lineno + 1) if doc is not None and doc.end_lineno else 0
    return (node.end_lineno or node.lineno) - start + 1 - doc_lines


def _oversized() -> list[str]:
    root = SHARDLIB.parent
    found: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            text = path.read_text()
            n = text.count("\n")
            if n > MAX_MODULE_LINES:
                found.append(f"{rel} ({n} lines)")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    size = _function_lines(node)
                    if size > MAX_FUNCTION_LINES:
                        found.append(f"{rel}:{node.name} ({size} lines)")
    return found


def test_modules_hold_one_idea_and_functions_stay_small() -> None:
    """Every module says its one idea in its docstring's first line; none passes the 900-line
    smoke alarm, no function passes 60 lines (docstring excluded), but the listed."""
    root = SHARDLIB.parent
    silent = [
        path.relative_to(root).as_posix()
        for package in PACKAGES
        for path in sorted((root / package).rglob("*.py"))
        if path.stat().st_size and not (ast.get_docstring(ast.parse(path.read_text())) or "")
    ]
    assert not silent, f"modules whose docstring does not say the one idea they hold: {silent}"
    over = _oversized()
    unexplained = [o for o in over if o.split(" (")[0] not in OVER_LIMITS]
    assert not unexplained, (
        f"over the size limits ({MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a "
        f"function): {unexplained}; a module this long holds more than one idea: split it where "
        "the ideas part, or list it in OVER_LIMITS with the reason"
    )
    stale = [k for k in OVER_LIMITS if not any(o.startswith(k + " (") for o in over)]
    assert not stale, f"OVER_LIMITS lists entries that are within the limits now: {stale}"


# -- the layers ---------------------------------------------------------------------------------

# Bottom to top: each layer may import only the layers before it (and itself). A public face
# belongs to the layer it fronts; ``shardlib/__init__.py`` stands above them all.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("_lang", ()),
    ("_env", ()),
    ("_check", ()),
    ("_analysis", ()),
    ("_ops", ("shardops",)),
    ("_shard_map", ("shardtypes",)),
    ("_pipeline", ("pipeline",)),
    ("_attention", ("attention",)),
    ("_moe", ("moe",)),
    ("_sampling", ("sampling",)),
    ("_explain", ()),
    ("_plan", ()),
)
# Modules that must not import JAX (plain data: testable and cacheable without a device).
NO_JAX = (
    "_lang",
    "_ops/*recipe*.py",
    "_pipeline/arguments.py",
    "_pipeline/arithmetic.py",
    "_pipeline/cost.py",
    "_pipeline/placement.py",
    "_pipeline/registry.py",
    "_pipeline/scopes.py",
    "_pipeline/tables.py",
    "_attention/chunks.py",
    "_attention/rules.py",
    "_moe/capacity.py",
    "_sampling/rules.py",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SHARDLIB.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The shardlib modules ``path`` imports, at any depth (in functions, under
    ``TYPE_CHECKING``): the real import graph, resolved to module names."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from . import frames`
    modules = _all_modules()
    return {m for m in out if m in modules and m != me}


def _all_modules() -> set[str]:
    return {_module_name(p) for p in SHARDLIB.rglob("*.py")}


def _layer(module: str) -> int | None:
    """The layer index of a module (None: the package's ``__init__``, above every layer)."""
    rest = module.split(".")[1:]
    if not rest:
        return None
    for k, (pkg, faces) in enumerate(LAYERS):
        if rest[0] == pkg or rest[0] in faces:
            return k
    raise AssertionError(f"{module} is in no layer: add its subpackage to LAYERS")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer above its own, as 'a -> b (layer i -> j)'."""
    bad = []
    for a, targets in sorted(graph.items()):
        la = _layer(a)
        for b in sorted(targets):
            lb = _layer(b)
            if la is not None and (lb is None or lb > la):
                bad.append(
                    f"{a} -> {b} (layer {LAYERS[la][0]} imports {LAYERS[lb][0] if lb is not None else 'shardlib'})"
                )
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (strongly connected components of more than one module,
    or a module importing itself), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(SHARDLIB.rglob("*.py"))}


def test_no_import_cycles() -> None:
    """No module of shardlib imports itself through others (imports in functions count)."""
    found = cycles(import_graph())
    assert not found, f"import cycles in shardlib: {found}"


def test_layers_import_only_downward() -> None:
    """Each subpackage imports only the layers below it (docs/architecture.md's picture)."""
    bad = layer_violations(import_graph())
    assert not bad, "imports against the layer order (docs/architecture.md):\n" + "\n".join(bad)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return inner and f"{inner}.{node.attr}"
    return None


def private_uses(text: str, me: str, is_init: bool = False) -> list[str]:
    """Where the module ``me`` (source ``text``) reaches into another module's privates:
    ``from X import _name`` (relative or absolute; dunders excepted; a private *module*, such
    as a subpackage ``_ops``, is not a private name) and ``alias._name`` on a shardlib module
    it imported (``from .._env import rules as _rules`` then ``_rules._cache``). A helper two
    modules need gets a public name inside its private package (the house style)."""
    modules = _all_modules()
    package = me if is_init else me.rpartition(".")[0]
    tree = ast.parse(text)
    found: list[str] = []
    aliases: dict[str, str] = {}  # name in this module -> the shardlib module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    head = a.name.split(".")[0]
                    aliases[a.asname or head] = a.name if a.asname else head
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                if f"{mod}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{mod}.{a.name}"
                elif _is_private(a.name):
                    source = "." * node.level + (node.module or "")
                    found.append(f"line {node.lineno}: from {source} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            dotted = _dotted(node.value)
            head, _, rest = (dotted or "").partition(".")
            if head not in aliases:
                continue
            target = aliases[head] + ("." + rest if rest else "")
            if target in modules and f"{target}.{node.attr}" not in modules:
                found.append(f"line {node.lineno}: {dotted}.{node.attr}")
    return found


def test_no_module_imports_another_modules_privates() -> None:
    """No module of shardlib imports a private name from another or reads one off an imported
    module: what two modules share has a public name inside its private package."""
    found = [
        f"{p.relative_to(SHARDLIB).as_posix()} {use}"
        for p in sorted(SHARDLIB.rglob("*.py"))
        for use in private_uses(p.read_text(), _module_name(p), p.name == "__init__.py")
    ]
    assert not found, "private names used across modules (give them public names):\n" + (
        "\n".join(found)
    )


def test_the_private_check_sees_a_planted_violation() -> None:
    """The check above fails on each kind of reach it is for (so it cannot pass vacuously),
    and lets the public, the dunder and the private-module imports through."""
    me = "shardlib._ops.emit"
    planted = (
        "from .._lang.parsing import _helper\n"
        "from shardlib._check.checking import _cache as c\n"
        "from .._env import rules as _rules\n"
        "import shardlib._env.context as ctx\n"
        "import shardlib._env.frames\n"
        "_rules._table\n"
        "ctx._state.x\n"
        "shardlib._env.frames._depth\n"
    )
    found = private_uses(planted, me)
    assert sorted(f.split(": ", 1)[1] for f in found) == sorted(
        [
            "from .._lang.parsing import _helper",
            "from shardlib._check.checking import _cache",
            "_rules._table",
            "ctx._state",
            "shardlib._env.frames._depth",
        ]
    ), found
    allowed = (
        "from __future__ import annotations\n"
        "from .._lang.parsing import as_str as _as_str\n"
        "from .. import _env\n"
        "from . import run as _ops\n"
        "import shardlib\n"
        "_ops.run\n"
        "_ops.__name__\n"
        "shardlib._env.frames\n"
        "_as_str._x\n"
    )
    assert private_uses(allowed, me) == []


def test_every_subpackage_says_its_job_and_what_it_may_import() -> None:
    for pkg, _ in LAYERS:
        init = SHARDLIB / pkg / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80, f"shardlib/{pkg}/__init__.py: say in its docstring what it does"
        if pkg != "_lang":
            assert "May import" in doc, f"shardlib/{pkg}/__init__.py: say what it may import"
    flat = sorted(p.name for p in SHARDLIB.glob("_*.py") if p.name != "__init__.py")
    assert not flat, f"private modules outside the subpackages: {flat}"


def test_plans_and_parsers_import_no_jax() -> None:
    """The spec language and the op and schedule plans are plain Python."""
    paths = sorted(
        {
            p
            for pattern in NO_JAX
            for p in SHARDLIB.glob(pattern if "." in pattern else pattern + "/*.py")
        }
    )
    assert len(paths) >= 10, paths
    users = [
        p.relative_to(SHARDLIB).as_posix()
        for p in paths
        if any(m == "jax" or m.startswith("jax.") for m in _all_imports(p))
    ]
    assert not users, f"these modules must not import JAX: {users}"


def _all_imports(path: Path) -> set[str]:
    """What ``path`` imports when it is imported (a function may import JAX lazily: a spec
    converted to a ``PartitionSpec``)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module or "")
    return out


def test_the_checks_catch_a_cycle_and_an_upward_import() -> None:
    """The rules above fail on a deliberate cycle and a deliberate upward import."""
    graph = import_graph()
    graph["shardlib._lang.parsing"] = graph["shardlib._lang.parsing"] | {"shardlib._explain.hlo"}
    graph["shardlib._explain.hlo"] = graph["shardlib._explain.hlo"] | {"shardlib._lang.parsing"}
    assert any("shardlib._lang.parsing" in c for c in cycles(graph))
    assert any(
        b.startswith("shardlib._lang.parsing -> shardlib._explain.hlo")
        for b in layer_violations(graph)
    )


# -- variants are objects -------------------------------------------------------------------

REGISTRY = "_pipeline/registry.py"


def _schedule_name_tests(text: str, names: frozenset[str]) -> list[str]:
    """The comparisons in ``text`` against a schedule's name (``schedule == 'zb-h1'``,
    ``name in ('gpipe', 'circular')``): a dispatch on a variant's name."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, ast.Tuple | ast.Set | ast.List) else [side]
            if any(isinstance(i, ast.Constant) and i.value in names for i in items):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
                break
    return found


def test_no_module_but_the_registry_tests_a_schedules_name() -> None:
    """Pipeline schedules are `Schedule` objects in ``_pipeline/registry.py``; every other
    module asks a schedule for its properties instead of comparing its name."""
    from shardlib._pipeline.registry import SCHEDULES

    names = frozenset(s.name for s in SCHEDULES) | frozenset(s.scope for s in SCHEDULES)
    tests = [
        f"{name}: {hit}"
        for name, text in _sources().items()
        if name != REGISTRY
        for hit in _schedule_name_tests(text, names)
    ]
    assert not tests, f"schedule names tested outside shardlib/{REGISTRY}: {tests}"
    # The check sees what it is for (so it cannot pass vacuously).
    assert _schedule_name_tests('if schedule == "zb-v": pass\n', names)
    assert _schedule_name_tests('x = s in ("gpipe", "circular")\n', names)
    assert not _schedule_name_tests("x = s.name == other\n", names)
