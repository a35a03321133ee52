"""The scorer core without a server: validation, ordering, batching, deadline, conversions."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from retrieval.v1 import rerank_pb2
from services.common.deadline import Deadline
from services.common.domain import Document, Hit
from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.rerank.checkpoint import CeliConfig
from services.rerank.domain import RerankQuery, RerankResult
from services.rerank.serve import convert
from services.rerank.serve.metrics import RerankMetrics
from services.rerank.serve.scorer import CeliScorer
from services.rerank.serve.settings import RerankSettings
from tests.support.rerank import tiny_scorer


@pytest.fixture(scope="module")
def scorer(tmp_path_factory: pytest.TempPathFactory) -> CeliScorer:
    return tiny_scorer(tmp_path_factory.mktemp("tiny"), RerankMetrics.create(CollectorRegistry()))


def _hit(i: int, text: str) -> Hit:
    return Hit(f"c{i}", 0.5 - i, i % 3, 0.5 - i, Document(f"c{i}", text))


def _query(texts: list[str], top_n: int = 0, query: str = "alpha beta") -> RerankQuery:
    return RerankQuery(query, tuple(_hit(i, t) for i, t in enumerate(texts)), top_n)


TEXTS = ["gamma", "alpha beta gamma delta " * 5, "", "zeta eta", "beta", "theta alpha"]


def test_batched_scores_do_not_depend_on_batching_or_order(scorer: CeliScorer) -> None:
    scores = scorer.score("alpha beta", TEXTS)
    one_by_one = np.array([scorer.score("alpha beta", [t])[0] for t in TEXTS])
    assert np.allclose(scores, one_by_one, atol=1e-5)
    reversed_scores = scorer.score("alpha beta", TEXTS[::-1])[::-1]
    assert np.allclose(scores, reversed_scores, atol=1e-5)


def test_score_terms_add_up_and_empty_text_scores_s_m(scorer: CeliScorer) -> None:
    terms = scorer.score_terms("alpha beta", TEXTS)
    assert np.allclose(terms["score"], terms["s_m"] + terms["s_l"], atol=1e-5)
    assert terms["s_l"][TEXTS.index("")] == 0.0  # empty document: no doc tokens
    assert np.array_equal(terms["score"], scorer.score("alpha beta", TEXTS))


def test_rerank_orders_by_score_and_keeps_request_positions(scorer: CeliScorer) -> None:
    result = scorer.rerank(_query(TEXTS, top_n=4))
    scores = scorer.score("alpha beta", TEXTS)
    order = list(np.argsort(-scores, kind="stable")[:4])
    assert list(result.order) == order and result.model == "tiny"
    # the candidates themselves come back, with the reranker's score and nothing else changed
    request = _query(TEXTS)
    assert list(result.hits) == [
        Hit(f"c{i}", float(scores[i]), i % 3, 0.5 - i, request.candidates[i].document)
        for i in order
    ]
    assert len(scorer.rerank(_query(TEXTS)).hits) == len(TEXTS)  # 0 = all


def test_metrics_count_pairs_and_batches(scorer: CeliScorer) -> None:
    assert scorer.metrics is not None
    before = scorer.metrics.pairs._value.get()
    scorer.score("alpha", TEXTS)
    assert scorer.metrics.pairs._value.get() - before == len(TEXTS)


@pytest.mark.parametrize(
    ("request_", "why"),
    [
        (_query(["a"], query=""), "query"),
        (_query(["a"], query=" \t"), "query"),
        (_query([]), "candidates"),
        (_query(["a"] * 1001), "at most 1000"),
        (_query(["a", "b"], top_n=3), "top_n"),
    ],
)
def test_invalid_requests(scorer: CeliScorer, request_: RerankQuery, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        scorer.rerank(request_)


def test_deadline_is_checked_between_batches(scorer: CeliScorer) -> None:
    with pytest.raises(DeadlineExceeded):
        scorer.rerank(_query(TEXTS), Deadline(time.monotonic() - 1.0))

    class OneBatch(Deadline):
        calls = 0

        def check(self, stage: str) -> None:
            OneBatch.calls += 1
            if OneBatch.calls > 2:  # tokenization and the first batch pass
                raise DeadlineExceeded(f"deadline exceeded before {stage}")

    with pytest.raises(DeadlineExceeded, match="batch 2/2"):
        scorer.rerank(_query(TEXTS), OneBatch(None))


def test_proto_round_trips_through_bytes() -> None:
    """Request and answer to bytes and back: the server reads the gateway's hits as they
    were sent, the gateway gets its own hits back, reordered, with the reranker's scores."""
    sent = (
        Hit("a", 0.75, 2, 0.75, Document("a", "body", title="Title")),
        Hit("b", -0.5, 0, -0.5, None),
    )
    wire = rerank_pb2.RerankRequest.FromString(
        convert.query_to_pb(RerankQuery("q", sent, top_n=1)).SerializeToString()
    )
    read = convert.query_from_pb(wire)
    assert (read.query, read.top_n) == ("q", 1)
    assert [(h.id, h.shard, h.first_stage_score) for h in read.candidates] == [
        ("a", 2, 0.75),
        ("b", 0, -0.5),
    ]
    assert [h.document.embedding_text for h in read.candidates if h.document] == ["Title body", ""]

    scored = RerankResult((dataclasses.replace(read.candidates[1], score=1.5),), (1,), "celi:m")
    answer = rerank_pb2.RerankResponse.FromString(convert.result_to_pb(scored).SerializeToString())
    back = convert.result_from_pb(answer, sent)
    assert back == RerankResult((Hit("b", 1.5, 0, -0.5, None),), (1,), "celi:m")


@pytest.mark.parametrize(("index", "doc_id"), [(2, "a"), (1, "a")])
def test_an_answer_naming_a_candidate_the_request_did_not_have_is_unavailable(
    index: int, doc_id: str
) -> None:
    sent = (Hit("a", 1.0, 0, 1.0), Hit("b", 0.5, 0, 0.5))
    answer = rerank_pb2.RerankResponse(hits=[rerank_pb2.RerankedHit(id=doc_id, index=index)])
    with pytest.raises(Unavailable, match="malformed"):
        convert.result_from_pb(answer, sent)


def test_settings_defaults_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RerankSettings().port == 50071 and RerankSettings().checkpoint is None
    monkeypatch.setenv("GTR_RERANK_BATCH_SIZE", "8")
    monkeypatch.setenv("GTR_RERANK_CHECKPOINT", "/ckpt")
    settings = RerankSettings()
    assert (settings.batch_size, settings.checkpoint) == (8, "/ckpt")


def test_cli_registers_serve_train_eval() -> None:
    import argparse

    from services.cli.rerank_commands import add_cli

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    args, extra = parser.parse_known_args(["rerank", "serve", "--port", "0"])
    assert args.passthrough and extra == ["--port", "0"]
    args = parser.parse_args(["rerank", "train", "--data", "d", "--out", "o", "--resume"])
    assert args.resume and args.negatives == 7 and args.variant == "celi"
    args = parser.parse_args(
        ["rerank", "eval", "--data", "d", "--checkpoint", "a", "--checkpoint", "b"]
    )
    assert args.checkpoint == ["a", "b"] and callable(args.handler)


def test_checkpoint_config_round_trip(tmp_path: Path) -> None:
    cfg = CeliConfig(variant="meanpool", d_tok=1, training={"steps": 3})
    cfg.write(tmp_path / "c.json")
    assert CeliConfig.read(tmp_path / "c.json") == cfg
    with pytest.raises(InvalidArgument):
        CeliConfig(max_len=40)
