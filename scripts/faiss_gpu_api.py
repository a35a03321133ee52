"""Extract the GPU part of faiss-gpu's Python API (names, and attributes per class) to JSON.

No GPU and no install needed: the faiss-gpu wheel is downloaded (not installed) and its
SWIG-generated ``faiss/swigfaiss.py`` is read as text. The wheel's SWIG proxies do not
refuse attributes they do not declare: a misspelt or misplaced option
(``GpuClonerOptions.useFloat16LookupTables``, a field of ``GpuIndexIVFPQConfig``) becomes
a plain Python attribute faiss never reads, silently ignored on a GPU node (faiss 1.15.1:
``faiss.SearchParametersIVF().useFloat16LookupTables = True`` passes). So the CPU tests
(``tests/unit/test_index_gpu.py``) check every name the GPU path sets against this
extract; they are the guard.

    pip download faiss-gpu==1.15.1 --no-deps -d /tmp/fg
    python scripts/faiss_gpu_api.py /tmp/fg/faiss_gpu-1.15.1-*.whl \
        > tests/support/faiss_gpu_api.json
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from pathlib import Path

# the classes and module names the GPU path may touch (all GPU classes, and the search
# parameters it passes per call)
KEEP_CLASS = re.compile(r"Gpu|^SearchParameters(IVF)?$")
KEEP_NAME = re.compile(r"gpu|GPU|Gpu|^INDICES_|^SearchParameters")


def _class_members(node: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return names


def extract(source: str, version: str) -> dict[str, object]:
    tree = ast.parse(source)
    classes: dict[str, tuple[list[str], set[str]]] = {}
    module: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
            classes[node.name] = (bases, _class_members(node))
            module.add(node.name)
        elif isinstance(node, ast.FunctionDef):
            module.add(node.name)
        elif isinstance(node, ast.Assign):
            module.update(t.id for t in node.targets if isinstance(t, ast.Name))

    def members(name: str) -> set[str]:
        if name not in classes:
            return set()
        bases, own = classes[name]
        out = set(own)
        for base in bases:
            out |= members(base)
        return out

    return {
        "faiss_gpu_version": version,
        "source": "faiss/swigfaiss.py of the faiss-gpu wheel",
        "module": sorted(n for n in module if KEEP_NAME.search(n)),
        "classes": {
            name: sorted(m for m in members(name) if not m.startswith("_") or m == "__init__")
            for name in sorted(classes)
            if KEEP_CLASS.search(name)
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path, help="a downloaded faiss-gpu wheel (.whl)")
    args = parser.parse_args(argv)
    match = re.match(r"faiss_gpu-([^-]+)-", args.wheel.name)
    if match is None:
        parser.error(f"{args.wheel.name} is not a faiss-gpu wheel")
    with zipfile.ZipFile(args.wheel) as wheel:
        source = wheel.read("faiss/swigfaiss.py").decode()
    json.dump(extract(source, match.group(1)), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
