"""What the generator sends: Search, BatchSearch, Upsert, or a weighted mix of them.

Queries come from a BEIR ``queries.jsonl`` (default: SciFact's under ``$GTR_DATA_DIR`` or
``../shared/data``, else the stdlib example searches of ``gtr-retrieval up``); documents
for Upsert from a BEIR ``corpus.jsonl`` (default: SciFact's corpus), upserted under their
own id prefix (``--id-prefix``, default ``loadtest:``) so a load test never overwrites the
corpus it searches. Every request of a run is built before the run starts, so building
protobufs costs the sender nothing while it keeps the schedule.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import numpy as np
from google.protobuf.message import Message

from retrieval.v1 import documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc

Op = Literal["search", "batch", "upsert"]
OPS: tuple[Op, ...] = ("search", "batch", "upsert")
Mode = Literal["", "hybrid", "dense", "sparse"]
MODES: dict[str, search_pb2.RetrievalMode.ValueType] = {
    "": search_pb2.RETRIEVAL_MODE_UNSPECIFIED,
    "hybrid": search_pb2.RETRIEVAL_MODE_HYBRID,
    "dense": search_pb2.RETRIEVAL_MODE_DENSE,
    "sparse": search_pb2.RETRIEVAL_MODE_SPARSE,
}
DATA_DIR = Path(
    os.environ.get("GTR_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data")
)
DEFAULT_QUERIES = DATA_DIR / "scifact" / "queries.jsonl"
DEFAULT_CORPUS = DATA_DIR / "scifact" / "corpus.jsonl"


def load_queries(path: Path | None) -> list[str]:
    """Query texts of a BEIR queries.jsonl; None: the default file, else the stdlib examples.

    A path that was asked for and is missing or empty is an error, not a silent fallback.
    """
    if path is None:
        if not DEFAULT_QUERIES.exists():
            from services.stack.config import STDLIB_EXAMPLES

            return list(STDLIB_EXAMPLES)
        path = DEFAULT_QUERIES
    texts: list[str] = []
    with Path(path).open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a BEIR query line ({exc})") from None
            if isinstance(text, str) and text.strip():
                texts.append(text.strip())
    if not texts:
        raise ValueError(f"{path}: no queries")
    return texts


def load_documents(path: Path | None, limit: int) -> list[tuple[str, str]]:
    """(title, text) of the first ``limit`` documents of a BEIR corpus.jsonl."""
    from services.corpus.readers import read_corpus

    path = DEFAULT_CORPUS if path is None else path
    if not Path(path).exists():
        raise ValueError(f"{path}: no corpus for the upserts (--corpus)")
    return [(d.title, d.text) for d in read_corpus(path, limit=limit)]


def parse_mix(spec: str) -> dict[Op, float]:
    """``search=8,upsert=1`` (weights; a bare ``search`` is weight 1) → normalised shares."""
    weights: dict[Op, float] = {}
    for part in spec.split(","):
        name, _, weight = part.strip().partition("=")
        if name not in OPS:
            raise ValueError(f"unknown operation {name!r} in --mix; known: {', '.join(OPS)}")
        value = float(weight) if weight else 1.0
        if value < 0:
            raise ValueError(f"--mix weight of {name} must be >= 0")
        weights[name] = value  # type: ignore[index]
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("--mix needs a positive weight")
    return {op: w / total for op, w in weights.items() if w > 0}


@dataclass(frozen=True)
class Workload:
    queries: Sequence[str]
    mix: dict[Op, float] = field(default_factory=lambda: {"search": 1.0})
    k: int = 10
    rerank: bool = False
    rerank_depth: int = 0  # 0: the gateway picks the depth that fits the deadline
    batch_size: int = 8  # queries per BatchSearch
    documents: Sequence[tuple[str, str]] = ()  # (title, text) for Upsert
    upsert_docs: int = 1  # documents per Upsert
    id_prefix: str = "loadtest:"
    mode: Mode = ""  # a Search's retrieval mode; "": the gateway's default (hybrid)

    def __post_init__(self) -> None:
        if "upsert" in self.mix and not self.documents:
            raise ValueError("upserts need documents (--corpus)")
        if not self.queries and set(self.mix) & {"search", "batch"}:
            raise ValueError("searches need queries (--queries)")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: one of {', '.join(m for m in MODES if m)}")

    def _search(self, rng: np.random.Generator) -> search_pb2.SearchRequest:
        return search_pb2.SearchRequest(
            query=self.queries[int(rng.integers(len(self.queries)))],
            k=self.k,
            rerank=search_pb2.RerankOptions(enabled=self.rerank, depth=self.rerank_depth),
            mode=MODES[self.mode],
        )

    def requests(self, n: int, seed: int, run_tag: str = "") -> tuple[list[Op], list[Message]]:
        """The operation and request message of each of ``n`` requests (seeded)."""
        rng = np.random.default_rng(seed)
        names = list(self.mix)
        picks = rng.choice(len(names), size=n, p=[self.mix[o] for o in names])
        ops: list[Op] = [names[int(i)] for i in picks]
        messages: list[Message] = []
        for i, op in enumerate(ops):
            if op == "search":
                messages.append(self._search(rng))
            elif op == "batch":
                batch = [self._search(rng) for _ in range(self.batch_size)]
                messages.append(search_pb2.BatchSearchRequest(requests=batch))
            else:
                docs = []
                for j in range(self.upsert_docs):
                    title, text = self.documents[int(rng.integers(len(self.documents)))]
                    doc_id = f"{self.id_prefix}{run_tag}{i}-{j}"
                    docs.append(documents_pb2.Document(id=doc_id, title=title, text=text))
                messages.append(documents_pb2.UpsertRequest(documents=docs))
        return ops, messages


Call = Callable[..., Awaitable[Any]]


def callers(channel: grpc.aio.Channel) -> dict[Op, Call]:
    """The stub method of each operation on ``channel``."""
    search = search_pb2_grpc.SearchServiceStub(channel)
    documents = documents_pb2_grpc.DocumentServiceStub(channel)
    return {"search": search.Search, "batch": search.BatchSearch, "upsert": documents.Upsert}


def answers(reply: Message) -> list[search_pb2.SearchResponse]:
    """The search answers in a reply (none for an upsert)."""
    if isinstance(reply, search_pb2.SearchResponse):
        return [reply]
    if isinstance(reply, search_pb2.BatchSearchResponse):
        return list(reply.responses)
    return []


def is_partial(reply: Message) -> bool:
    """A search answered without every shard (``partial``); any of a batch's answers."""
    return any(r.partial for r in answers(reply))


def rerank_skipped(reply: Message) -> bool:
    """A search that asked for the rerank and was answered without it (any of a batch)."""
    return any(r.rerank_skipped for r in answers(reply))
