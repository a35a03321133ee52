"""Contrastive entropy (Fang et al., "Scaling Laws for Dense Retrieval", SIGIR 2024).

For every relevant (query, document) pair: −log of the pair's softmax probability against
``negatives`` (256) documents drawn at random from the corpus (never one of the query's
relevant documents); the figure is the mean over all pairs. Lower is better; it is
continuous where nDCG is a step function, which is why the paper fits its scaling laws
to it. Scores are the model's similarities divided by ``temperature``: the encoder's
training temperature, 0.05 for all-MiniLM-L6-v2 (sentence-transformers'
MultipleNegativesRankingLoss, scale 20). With raw cosines (temperature 1) every model
scores close to log(257) ≈ 5.55 and the figure says nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from services.common.errors import InvalidArgument

NEGATIVES = 256
TEMPERATURE = 0.05


def contrastive_entropy(
    query_vectors: np.ndarray,
    doc_vectors: np.ndarray,
    pairs: Sequence[tuple[int, int]],
    relevant: Mapping[int, set[int]],
    negatives: int = NEGATIVES,
    temperature: float = TEMPERATURE,
    seed: int = 0,
) -> float:
    """Mean −log p(d⁺ | q, d⁺ ∪ N) over ``pairs`` of (query row, relevant doc row).

    ``relevant[q]``: every relevant doc row of query row ``q`` (none is drawn as a negative).
    Negatives are drawn per pair with a generator seeded by ``seed``.
    """
    if temperature <= 0:
        raise InvalidArgument("temperature must be > 0")
    if not pairs:
        raise InvalidArgument("no relevant (query, document) pair to measure")
    n_docs = doc_vectors.shape[0]
    rng = np.random.default_rng(seed)
    losses = np.empty(len(pairs), dtype=np.float64)
    for i, (q, d) in enumerate(pairs):
        allowed = n_docs - len(relevant.get(q, {d}) | {d})
        if allowed < negatives:
            raise InvalidArgument(
                f"{negatives} negatives need a corpus of more than "
                f"{n_docs - allowed + negatives - 1} documents"
            )
        negs = _draw(rng, n_docs, negatives, relevant.get(q, set()) | {d})
        candidates = np.concatenate(([d], negs))
        logits = (doc_vectors[candidates] @ query_vectors[q]).astype(np.float64) / temperature
        top = logits.max()
        losses[i] = -(logits[0] - top - np.log(np.exp(logits - top).sum()))
    return float(losses.mean())


def _draw(rng: np.random.Generator, n: int, k: int, exclude: set[int]) -> np.ndarray:
    """``k`` distinct rows of ``range(n)``, none in ``exclude``."""
    out: list[int] = []
    seen = set(exclude)
    while len(out) < k:
        for row in rng.choice(n, size=2 * (k - len(out)), replace=True).tolist():
            if row not in seen:
                seen.add(row)
                out.append(row)
                if len(out) == k:
                    break
    return np.asarray(out, dtype=np.int64)
