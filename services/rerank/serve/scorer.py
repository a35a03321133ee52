"""The scorer core: (query, candidates) → scores / ranked hits. No grpc here.

* The query is cut to ``max_query_len`` (64) tokens, each pair to ``max_len`` (256)
  tokens by truncating the document (``[CLS] q [SEP] d [SEP]``).
* User text never produces special tokens (``split_special_tokens``): a literal
  "[SEP]" in a document is text, not a segment boundary.
* Pairs are sorted by length and scored in batches of ``batch_size`` under
  ``torch.inference_mode()`` on the model's device; the deadline is checked before
  every batch, so a call fails with DeadlineExceeded instead of overrunning it (by at
  most one batch).
* An empty candidate text is scored as an empty document: no document tokens, so
  ``s_l = 0`` and the score is ``s_m`` (it is not an error).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.common.deadline import Deadline
from services.common.errors import InvalidArgument
from services.rerank.checkpoint import CeliConfig
from services.rerank.domain import MAX_CANDIDATES, RerankQuery, RerankResult, candidate_text
from services.rerank.model import CeliModel
from services.rerank.serve.metrics import RerankMetrics


@dataclass(frozen=True)
class PairBatch:
    """Padded tensors of one forward pass and the request positions of its rows."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    rows: np.ndarray


class PairEncoder:
    """Tokenizes (query, doc) pairs with the checkpoint's limits; pads batches."""

    def __init__(self, tokenizer: Any, max_query_len: int, max_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_query_len = max_query_len
        self.max_len = max_len
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)

    def truncate_query(self, query: str) -> str:
        enc = self.tokenizer(
            query,
            add_special_tokens=False,
            return_offsets_mapping=True,
            split_special_tokens=True,
        )
        offsets = enc["offset_mapping"]
        if len(offsets) <= self.max_query_len:
            return query
        return query[: offsets[self.max_query_len - 1][1]]

    def encode(self, query: str, docs: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Token ids and token type ids of every pair, unpadded."""
        q = self.truncate_query(query)
        enc = self.tokenizer(
            [q] * len(docs),
            docs,
            truncation="only_second",
            max_length=self.max_len,
            split_special_tokens=True,
            return_token_type_ids=True,
        )
        ids = enc["input_ids"]
        types = enc.get("token_type_ids") or [[0] * len(x) for x in ids]
        return ids, types

    def pad(
        self, ids: list[list[int]], types: list[list[int]], rows: np.ndarray | None = None
    ) -> PairBatch:
        """One batch of the pairs ``rows`` (default: all, in order), padded to the longest."""
        rows = np.arange(len(ids)) if rows is None else rows
        width = max(len(ids[r]) for r in rows)
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        tt = np.zeros((len(rows), width), dtype=np.int64)
        for k, r in enumerate(rows):
            n = len(ids[r])
            input_ids[k, :n], mask[k, :n], tt[k, :n] = ids[r], 1, types[r]
        return PairBatch(
            torch.from_numpy(input_ids), torch.from_numpy(mask), torch.from_numpy(tt), rows
        )

    def batches(
        self, ids: list[list[int]], types: list[list[int]], batch_size: int
    ) -> list[PairBatch]:
        """Length-sorted batches (longest first), each padded to its own longest pair."""
        order = np.argsort([-len(x) for x in ids], kind="stable")
        return [
            self.pad(ids, types, order[s : s + batch_size])
            for s in range(0, len(order), batch_size)
        ]


def validate(request: RerankQuery) -> int:
    """Check a request; return the number of hits to answer with."""
    if not request.query.strip():
        raise InvalidArgument("query must not be empty")
    n = len(request.candidates)
    if n == 0:
        raise InvalidArgument("candidates must not be empty")
    if n > MAX_CANDIDATES:
        raise InvalidArgument(f"at most {MAX_CANDIDATES} candidates per request, got {n}")
    if request.top_n < 0 or request.top_n > n:
        raise InvalidArgument(f"top_n must be in 0..{n} (0 = all), got {request.top_n}")
    return request.top_n or n


class CeliScorer:
    """A loaded reranker. Thread-safe: one scoring call at a time runs the model."""

    def __init__(
        self,
        model: CeliModel,
        tokenizer: Any,
        config: CeliConfig,
        name: str,
        batch_size: int = 16,
        metrics: RerankMetrics | None = None,
    ) -> None:
        if batch_size < 1:
            raise InvalidArgument("batch_size must be >= 1")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.config = config
        self.name = name
        self.batch_size = batch_size
        self.metrics = metrics
        self.pairs = PairEncoder(tokenizer, config.max_query_len, config.max_len)
        self._lock = threading.Lock()

    def score(self, query: str, docs: list[str], deadline: Deadline | None = None) -> np.ndarray:
        """float32 scores (``s_m + s_l``), one per doc, in input order."""
        return self.score_terms(query, docs, deadline)["score"]

    def score_terms(
        self, query: str, docs: list[str], deadline: Deadline | None = None
    ) -> dict[str, np.ndarray]:
        """``{"s_m", "s_l", "score"}``: float32 arrays, one value per doc, in input order."""
        deadline = deadline or Deadline(None)
        deadline.check("rerank tokenization")
        ids, types = self.pairs.encode(query, docs)
        batches = self.pairs.batches(ids, types, self.batch_size)
        terms = {name: np.empty(len(docs), dtype=np.float32) for name in ("s_m", "s_l", "score")}
        start = time.perf_counter()
        with self._lock, torch.inference_mode():
            for k, batch in enumerate(batches):
                deadline.check(f"rerank batch {k + 1}/{len(batches)}")
                out = self.model(
                    *(
                        t.to(self.device)
                        for t in (batch.input_ids, batch.attention_mask, batch.token_type_ids)
                    )
                )
                for name, values in (("s_m", out.s_m), ("s_l", out.s_l), ("score", out.score)):
                    terms[name][batch.rows] = values.float().cpu().numpy()
                if self.metrics is not None:
                    self.metrics.batch_size.observe(len(batch.rows))
                    self.metrics.pairs.inc(len(batch.rows))
        if self.metrics is not None:
            self.metrics.latency.observe(time.perf_counter() - start)
        return terms

    def rerank(self, request: RerankQuery, deadline: Deadline | None = None) -> RerankResult:
        top_n = validate(request)
        candidates = request.candidates
        scores = self.score(request.query, [candidate_text(c) for c in candidates], deadline)
        order = np.argsort(-scores, kind="stable")[:top_n].tolist()
        hits = tuple(dataclasses.replace(candidates[i], score=float(scores[i])) for i in order)
        return RerankResult(hits, tuple(order), self.name)
