"""A search as one shard sees it, and its answer: plain data, no grpc, no FAISS."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Hit = tuple[str, float]  # (doc id, score)
FilterSpec = Sequence[tuple[str, Sequence[str]]]  # (key, any_of) conditions, all must hold


class Consistency(enum.Enum):
    EVENTUAL = "eventual"
    SESSION = "session"
    STRONG = "strong"


@dataclass(frozen=True)
class ShardQuery:
    shard: int
    vectors: np.ndarray
    k: int
    nprobe: int = 0
    filter: FilterSpec = ()
    consistency: Consistency = Consistency.EVENTUAL
    min_position: str = ""


@dataclass
class ShardAnswer:
    hits: list[list[Hit]]
    shard: int
    replica: str
    applied_position: str
