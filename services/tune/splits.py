"""The three query splits of a tuning run: train, validation and dev.

``dev`` is exactly the split every trainer of this project holds out
(:func:`services.corpus.beir.split_queries` of the judged queries with the seed and the
dev fraction), so ``encoder train``, ``rerank train`` and ``tune`` all report on the same
queries and none of them ever trains on one. ``val`` is a share of the remaining train
queries, held out of the encoder's and the reranker's training too: every setting
``tune`` chooses (fusion, rerank depth and weight, which system is best) is chosen on it,
so the dev figures are not tuned to dev.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from services.common.errors import InvalidArgument
from services.corpus.beir import split_queries


@dataclass(frozen=True)
class Split:
    seed: int
    dev_fraction: float
    val_fraction: float
    train: tuple[str, ...]
    val: tuple[str, ...]
    dev: tuple[str, ...]

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))


def make_split(
    qrels: Mapping[str, Mapping[str, int]], seed: int, dev_fraction: float, val_fraction: float
) -> Split:
    judged = sorted(q for q, rels in qrels.items() if any(v > 0 for v in rels.values()))
    if len(judged) < 3:
        raise InvalidArgument(
            f"{len(judged)} judged queries: tune needs at least 3 (train, validation, dev)"
        )
    rest, dev = split_queries(judged, seed, dev_fraction)
    train, val = split_queries(rest, seed, val_fraction)
    if not train:
        raise InvalidArgument("the dev and validation fractions leave no training query")
    return Split(seed, dev_fraction, val_fraction, tuple(train), tuple(val), tuple(dev))
