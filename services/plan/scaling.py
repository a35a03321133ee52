"""Model size vs annotated data (Fang et al., "Scaling Laws for Dense Retrieval", SIGIR 2024).

The paper fits the contrastive entropy ``L`` (:mod:`services.measures.entropy`) of a dense
retriever with ``N`` non-embedding parameters trained on ``D`` annotated queries as

    L(N, D) = ((A / N)^(α/β) + B / D)^β + δ

and uses it to spend a budget between a larger model (training and, above all, serving
cost ∝ N) and more annotations (cost ∝ D). The constants depend on the data, the backbone
family and the annotation quality, so this module does not ship any: give the fit of
your own runs (``--scaling-fit FILE``: ``{"A", "alpha", "B", "beta", "delta", "source"}``;
``gtr-retrieval eval`` reports the contrastive entropy to fit them on). Without a fit the
table still shows the serving side of the trade-off, which this service measures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidArgument, NotFound
from services.encoder.profiles import PROFILES


@dataclass(frozen=True)
class ScalingFit:
    A: float
    alpha: float
    B: float
    beta: float
    delta: float
    source: str

    @classmethod
    def read(cls, path: Path) -> ScalingFit:
        if not Path(path).exists():
            raise NotFound(f"{path}: no such scaling-law fit")
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
            A, alpha, B, beta, delta = (float(raw[k]) for k in ("A", "alpha", "B", "beta", "delta"))
            fit = cls(A, alpha, B, beta, delta, source=str(raw.get("source", path)))
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidArgument(
                f"{path}: needs numbers A, alpha, B, beta, delta ({exc})"
            ) from None
        if min(fit.A, fit.alpha, fit.B, fit.beta) <= 0:
            raise InvalidArgument(f"{path}: A, alpha, B and beta must be > 0")
        return fit

    def entropy(self, params: float, annotations: float) -> float:
        """L(N, D) of the joint law."""
        if params <= 0 or annotations <= 0:
            raise InvalidArgument("parameters and annotations must be > 0")
        inner = (self.A / params) ** (self.alpha / self.beta) + self.B / annotations
        return float(inner**self.beta + self.delta)

    def annotations_for(self, params: float, target: float) -> float | None:
        """D that brings a model of ``params`` to entropy ``target``; None: out of reach."""
        room = (target - self.delta) ** (1 / self.beta) - (self.A / params) ** (
            self.alpha / self.beta
        )
        return self.B / room if target > self.delta and room > 0 else None


@dataclass(frozen=True)
class SizeRow:
    size: str
    params_millions: int
    dim: int
    latency_ms: float  # batch-1 latency of the profile
    relative_serving_cost: float  # params / GTR-base params (encoder FLOPs per query)
    entropy: float | None  # L(N, D) at the given annotations (with a fit)
    annotations_to_match: float | None  # D this size needs for the base model's L (with a fit)


def size_table(fit: ScalingFit | None, annotations: float | None) -> list[SizeRow]:
    base = PROFILES["base"].params_millions * 1e6
    rows = []
    target = fit.entropy(base, annotations) if fit and annotations else None
    for name in ("minilm", "base", "large", "xl", "xxl"):
        p = PROFILES[name]
        n = p.params_millions * 1e6
        rows.append(
            SizeRow(
                name,
                p.params_millions,
                p.dim,
                p.slo_ms,
                round(n / base, 2),
                fit.entropy(n, annotations) if fit and annotations else None,
                fit.annotations_for(n, target) if fit and target is not None else None,
            )
        )
    return rows
