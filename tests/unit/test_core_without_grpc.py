"""The core never imports grpc or the generated protobufs (docs/architecture.md; STYLE):
the shared words, the host plumbing, the shard, the encoder and reranker models, the
gateway's pipeline and the generations' policy are tested without a server, and a
servicer is the only place a proto meets them. Read with ``ast``, so a lazy import inside
a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# (folder, the modules of it that are the RPC edge and may import grpc / retrieval.v1)
CORE: tuple[tuple[str, frozenset[str]], ...] = (
    ("services/common", frozenset()),
    ("services/process", frozenset()),
    ("services/measures", frozenset()),
    ("services/corpus", frozenset()),
    ("services/index/core", frozenset()),
    ("services/encoder", frozenset()),
    ("services/encoder/train", frozenset()),
    ("services/rerank", frozenset()),
    ("services/rerank/train", frozenset()),
    ("services/rerank/serve", frozenset({"convert.py", "server.py", "servicer.py"})),
    ("services/index/server", frozenset({"process.py", "seeding.py", "servicer.py"})),
    (
        "services/gateway",
        frozenset({"convert.py", "rerank_client.py", "server.py", "servicer.py"}),
    ),
    ("services/generations", frozenset({"replicas.py"})),
)
FORBIDDEN = ("grpc", "retrieval")


def _imports(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize(("folder", "edge"), CORE, ids=[c[0] for c in CORE])
def test_the_core_imports_no_grpc(folder: str, edge: frozenset[str]) -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / folder).glob("*.py"))
        if path.name not in edge
        for line, name in _imports(path)
        if name.split(".")[0] in FORBIDDEN
    ]
    assert offending == [], "\n".join(offending)
