"""One evaluation from a config to a report (in-process, or through a gateway)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.eval import data as eval_data
from services.eval import report as eval_report
from services.eval.config import EvalConfig
from services.eval.inprocess import evaluate_in_process, exact_run
from services.eval.service import Connect, evaluate_through_gateway


def evaluate(
    cfg: EvalConfig,
    connect: Connect | None = None,
    ingest: Callable[[], int] | None = None,
) -> dict[str, Any]:
    """The report of :mod:`services.eval.report` for ``cfg``.

    In-process by default; with ``cfg.gateway``, ``connect`` opens a client of it and
    ``ingest`` (None: skip) upserts the corpus first. The contrastive entropy needs the
    embeddings, so the gateway path reports it from the in-process encoder, the model the
    service runs (the report says which).
    """
    data = eval_data.load(cfg)
    if cfg.gateway:
        if connect is None:
            raise ValueError("a gateway evaluation needs a client factory")
        systems = evaluate_through_gateway(data, cfg, connect, ingest)
        systems.runs = {"exact": exact_run(data), **systems.runs}
    else:
        systems = evaluate_in_process(data, cfg)
    entropy = eval_report.entropy_of(data, cfg)
    return eval_report.build(data, cfg, systems, entropy)
