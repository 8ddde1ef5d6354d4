"""Where the test suite's time goes, as the tables of ``docs/contributing.md``.

Regenerate the page's tables (runs the fast and the slow tier in this venv, ~15 minutes on
two cores)::

    python -m tests.cost_report --write docs/contributing.md

or render them from logs an earlier run left (``pytest --cost-log=DIR ...``)::

    python -m tests.cost_report --from DIR

The numbers come from ``tests/_cost_plugin.py``: each test's wall time and the part of it
spent tracing, lowering, compiling (JAX's own ``jax.monitoring`` events) and in subprocesses
(their CPU time). Wall times are summed over the xdist workers, so a tier's sum is about
``workers x`` its elapsed time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("trace", "lower", "compile", "child")
BEGIN = "<!-- cost-report:begin -->"
END = "<!-- cost-report:end -->"


def load(directory: Path) -> list[dict]:
    """Every row the plugin wrote under ``directory``."""
    return [
        json.loads(line)
        for path in sorted(directory.glob("*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].removeprefix("tests/")


def _row(name: str, rows: list[dict]) -> str:
    wall = sum(r["wall"] for r in rows)
    parts = {k: sum(r[k] for r in rows) for k in KINDS}
    rest = max(0.0, wall - sum(parts.values()))
    cells = [f"{parts[k]:.0f}" for k in KINDS]
    return f"| {name} | {len(rows)} | {wall:.0f} | " + " | ".join(cells) + f" | {rest:.0f} |"


def tier_table(rows: list[dict], top: int) -> list[str]:
    """The tier's total, then its ``top`` costliest files, in seconds summed over workers."""
    by_file: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_file[_file_of(r["id"])].append(r)
    ranked = sorted(by_file.items(), key=lambda kv: -sum(r["wall"] for r in kv[1]))
    out = [
        "| file | tests | wall s | trace s | lower s | compile s | subprocess s | run + Python s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        _row("**all files**", rows),
    ]
    out += [_row(f"`{name}`", file_rows) for name, file_rows in ranked[:top]]
    rest = [r for _, file_rows in ranked[top:] for r in file_rows]
    if rest:
        out.append(_row(f"{len(ranked) - top} other files", rest))
    return out


def slowest(rows: list[dict], top: int) -> list[str]:
    out = ["| test | wall s | compile s | subprocess s |", "|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: -r["wall"])[:top]:
        out.append(
            f"| `{r['id'].removeprefix('tests/')}` | {r['wall']:.1f} | "
            f"{r['compile']:.1f} | {r['child']:.1f} |"
        )
    return out


def render(rows: list[dict], elapsed: dict[str, float] | None = None) -> str:
    """The tables of each JAX version the rows ran on, fast tier then slow tier."""
    lines = [
        f"Measured on {os.cpu_count()} cores, `-n auto` (one worker per core); regenerate with "
        "`python -m tests.cost_report --write docs/contributing.md`, or render the logs of any "
        "run (`SHARDLIB_COST_LOG=DIR bash .ci/run`) with `python -m tests.cost_report --from DIR`.",
    ]
    tiers = (("fast tier", False), ("slow tier", True))
    for version in sorted({r.get("jax", "?") for r in rows}):
        for tier, slow in tiers:
            tier_rows = [r for r in rows if r.get("jax", "?") == version and r["slow"] == slow]
            if not any(r["wall"] > 0.05 for r in tier_rows):
                continue  # not run here (every test skipped)
            key = f"{version} {tier}"
            took = f", {elapsed[key] / 60:.1f} min elapsed" if elapsed and key in elapsed else ""
            ran = sum(1 for r in tier_rows if r["wall"] > 0)
            lines += ["", f"### JAX {version}, the {tier}: {ran} tests{took}", ""]
            lines += tier_table(tier_rows, top=20)
            lines += ["", "Its 15 slowest tests:", ""]
            lines += slowest(tier_rows, top=15)
    return "\n".join(lines) + "\n"


def run_tier(log: Path, slow: bool) -> float:
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-n",
        "auto",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--cost-log={log}",
    ]
    if slow:
        args += ["--runslow", "-m", "slow"]
    t0 = time.perf_counter()
    subprocess.run(args, cwd=ROOT, check=True)
    return time.perf_counter() - t0


def write(page: Path, text: str) -> None:
    """Replace what stands between the page's markers with ``text``."""
    old = page.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(old):
        raise SystemExit(f"{page} has no {BEGIN} ... {END} block to replace")
    page.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}{END}", old), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, help="render logs an earlier run left")
    parser.add_argument("--write", type=Path, help="put the tables into this page's markers")
    parser.add_argument("--fast-only", action="store_true", help="measure the fast tier only")
    args = parser.parse_args(argv)
    elapsed: dict[str, float] = {}
    if args.source:
        rows = load(args.source)
    else:
        import jax

        with tempfile.TemporaryDirectory() as tmp:
            elapsed[f"{jax.__version__} fast tier"] = run_tier(Path(tmp) / "fast", slow=False)
            if not args.fast_only:
                elapsed[f"{jax.__version__} slow tier"] = run_tier(Path(tmp) / "slow", slow=True)
            rows = load(Path(tmp) / "fast") + load(Path(tmp) / "slow")
    text = render(rows, elapsed)
    if args.write:
        write(args.write, text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
