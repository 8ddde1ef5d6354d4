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


# Size limits: a module a newcomer can read in one sitting, a function that fits on a screen.
MAX_MODULE_LINES = 450
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


def test_modules_and_functions_stay_small() -> None:
    """No module over 450 lines, no function over 60 (docstring excluded), but the listed."""
    over = _oversized()
    unexplained = [o for o in over if o.split(" (")[0] not in OVER_LIMITS]
    assert not unexplained, (
        f"over the size limits ({MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a "
        f"function): {unexplained}; split them, or list them in OVER_LIMITS with the reason"
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
    ("_explain", ()),
    ("_plan", ()),
)
# Modules that must not import JAX (plain data: testable and cacheable without a device).
NO_JAX = (
    "_lang",
    "_ops/*plan*.py",
    "_pipeline/plan.py",
    "_pipeline/tables.py",
    "_attention/plan.py",
    "_moe/plan.py",
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
