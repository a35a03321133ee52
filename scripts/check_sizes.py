#!/usr/bin/env python3
"""Print the hand-written modules and functions over the size limits, and fail if any.

Issue #32: no module over ~500 lines and no function over ~80 lines, so that a module is
read in one sitting and a function on one screen. A module counts its lines; a function
counts the lines from its ``def`` to its last line, its docstring left out. Flat
declarations (an argument table, a settings class's fields) are data, not control flow:
a function whose body is a run of calls that each add one declaration (``add_argument``,
``add_command`` and the like) is exempt when at least 90 % of its statements are such
calls, and so is any module listed in :data:`EXEMPT` with the reason.

Usage: ``python scripts/check_sizes.py [--json]``; exit status 1 when anything is over.
``tests/unit/test_sizes.py`` runs it in CI.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The trees of hand-written service code the limits hold for.
TREES = ("services",)
MODULE_LINES = 500
FUNCTION_LINES = 80
# Calls that declare one thing each (argparse's add_argument, add_parser, …, the CLI's own
# add_command / _add_onnx, pydantic's Field): a function made of them is a table.
DECLARING_PREFIXES = ("add_", "_add_")
DECLARING = frozenset({"Field", "set_defaults"})
FLAT_SHARE = 0.9
# Modules over the limit on purpose, each with its reason.
EXEMPT: dict[str, str] = {}


@dataclass(frozen=True)
class Offender:
    """One module or function over its limit."""

    path: str
    name: str
    lines: int
    limit: int


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        doc = body[0]
        doc_lines = (doc.end_lineno or doc.lineno) - doc.lineno + 1
    else:
        doc_lines = 0
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return (node.end_lineno or node.lineno) - start + 1 - doc_lines


def _is_flat(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    statements = [s for s in ast.walk(node) if isinstance(s, ast.stmt) and s is not node]
    declaring = 0
    for statement in statements:
        for call in ast.walk(statement):
            if isinstance(call, ast.Call):
                name = getattr(call.func, "attr", getattr(call.func, "id", ""))
                if name in DECLARING or name.startswith(DECLARING_PREFIXES):
                    declaring += 1
                    break
    return bool(statements) and declaring / len(statements) >= FLAT_SHARE


def offenders(root: Path = ROOT) -> list[Offender]:
    """Every module and function of :data:`TREES` over its limit."""
    found: list[Offender] = []
    for tree in TREES:
        for path in sorted((root / tree).rglob("*.py")):
            rel = str(path.relative_to(root))
            text = path.read_text(encoding="utf-8")
            lines = text.count("\n") + (not text.endswith("\n") and bool(text))
            if lines > MODULE_LINES and rel not in EXEMPT:
                found.append(Offender(rel, "<module>", lines, MODULE_LINES))
            for node in ast.walk(ast.parse(text, filename=rel)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    size = _body_lines(node)
                    if size > FUNCTION_LINES and not _is_flat(node):
                        found.append(Offender(rel, node.name, size, FUNCTION_LINES))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="One JSON line instead of a table.")
    args = parser.parse_args(argv)
    over = offenders()
    if args.json:
        print(json.dumps([asdict(o) for o in over]))
    else:
        for o in over:
            print(f"{o.path}:{o.name}: {o.lines} lines (limit {o.limit})")
        print(f"{len(over)} over the limits" if over else "all within the limits")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
