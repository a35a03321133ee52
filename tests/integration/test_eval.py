"""``gtr-retrieval eval`` end to end on a small BEIR folder made here: in-process (the
shard's own index code, the real MiniLM encoder, the embedding cache) and through a real
gateway with real shard servers and Redis.

The folder is built so that the right answer is known: each query is the text of one
document (a SciFact title), and both sides of MiniLM embed a text of under 64 tokens
alike, so exact search must put that document first: nDCG@10 = MRR@10 = Recall@100 = 1.
A wrong id mapping, rank order or measure wiring breaks that.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.cli.main import main
from tests.support.background import stack_in_background
from tests.support.processes import run_redis
from tests.support.rerank import tiny_checkpoint
from tests.support.shards import train_test_index

# the module's stack and encodes: ~40 s on two quiet cores, minutes on a busy machine
pytestmark = pytest.mark.slow

N_DOCS = 300  # PQ codebooks of 256 centroids need at least 256 training vectors
N_QUERIES = 24


@pytest.fixture(scope="module")
def beir(scifact_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("beir")
    titles: dict[str, str] = {}
    with (scifact_dir / "corpus.jsonl").open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            title = row["title"].strip()
            if 20 <= len(title) <= 150 and title not in titles.values():
                titles[str(row["_id"])] = title
            if len(titles) == N_DOCS:
                break
    (root / "qrels").mkdir()
    with (root / "corpus.jsonl").open("w", encoding="utf-8") as fh:
        for doc_id, title in titles.items():
            fh.write(json.dumps({"_id": doc_id, "title": "", "text": title}) + "\n")
    picked = list(titles)[:: N_DOCS // N_QUERIES][:N_QUERIES]
    with (root / "queries.jsonl").open("w", encoding="utf-8") as fh:
        for n, doc_id in enumerate(picked):
            fh.write(json.dumps({"_id": f"q{n}", "text": titles[doc_id]}) + "\n")
    with (root / "qrels" / "test.tsv").open("w", encoding="utf-8") as fh:
        fh.write("query-id\tcorpus-id\tscore\n")
        fh.writelines(f"q{n}\t{doc_id}\t1\n" for n, doc_id in enumerate(picked))
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("embedding-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GTR_CACHE_DIR", str(path))
        yield path


def run_eval(*args: str) -> tuple[int, list[str]]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["eval", "--quiet", *args])
    return code, out.getvalue().splitlines()


def last_json(lines: list[str]) -> dict[str, Any]:
    return dict(json.loads(lines[-1]))


@pytest.fixture(scope="module")
def in_process(beir: Path, cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("celi"))
    dev = [f"q{n}" for n in range(0, N_QUERIES, 2)]  # as the trainer writes it
    (ckpt / "split.json").write_text(json.dumps({"train": [], "dev": dev}))
    run_dir = tmp_path_factory.mktemp("eval-run")
    code, lines = run_eval(
        "--data",
        str(beir),
        "--split",
        "test",
        "--run-dir",
        str(run_dir),
        "--rerank-checkpoint",
        str(ckpt),
        "--rerank-depth",
        "10",
    )
    assert code == 0, lines
    return {"report": last_json(lines), "lines": lines, "run_dir": run_dir, "dev": dev}


def test_in_process_scores_exact_search_at_the_known_answer(in_process: dict[str, Any]) -> None:
    r = in_process["report"]
    assert r["queries"] == N_QUERIES and r["path"] == "in-process" and r["split"] == "test"
    for measure in ("ndcg_at_10", "recall_at_100", "mrr_at_10"):
        assert r[measure]["exact"] == 1.0, measure
    # IVF-PQ at its tuned default, at one list and at every list finds each query's own
    # document: the query is the document, so its nearest centroid holds it
    nlist = r["index"]["nlist"]
    for name in ("ivfpq_default", "ivfpq_nprobe_1", f"ivfpq_nprobe_{nlist}"):
        assert r["ndcg_at_10"][name] >= 0.9, name
    assert (Path(in_process["run_dir"]) / "index" / "manifest.json").exists()


def test_in_process_reports_rerank_on_held_out_queries_and_the_entropy(
    in_process: dict[str, Any],
) -> None:
    r = in_process["report"]
    rerank = r["rerank"]
    assert rerank["queries"] == len(in_process["dev"]) and rerank["depth"] == 10
    assert set(rerank["ndcg_at_10"]) == {"ivfpq_default", "ivfpq_default+rerank"}
    gain = rerank["gain_ndcg_at_10"]
    assert gain["wins"] + gain["losses"] + gain["ties"] == len(in_process["dev"])
    # a query's own text scores its document far above random ones: well below chance
    assert 0 < r["contrastive_entropy"] < math.log(257) / 2
    assert r["contrastive_entropy_setup"]["pairs"] == N_QUERIES
    table = "\n".join(in_process["lines"][:-1])
    assert "exact" in table and "held-out queries" in table and "contrastive entropy" in table


def test_in_process_reports_bm25_and_hybrid_on_the_dev_queries(
    in_process: dict[str, Any],
) -> None:
    r = in_process["report"]
    # each query is its document's whole text: BM25 and both fusions find it first too
    for name in ("bm25", "hybrid_rrf", "hybrid_weighted"):
        assert r["ndcg_at_10"][name] >= 0.9, name
    hybrid = r["hybrid"]
    assert hybrid["queries"] == len(in_process["dev"])  # the checkpoint's held-out queries
    assert set(hybrid["vs_dense"]) == {"bm25", "hybrid_rrf", "hybrid_weighted"}
    for name, c in hybrid["vs_dense"].items():
        n = c["ndcg_at_10"]
        assert n["wins"] + n["losses"] + n["ties"] == len(in_process["dev"]), name
    assert {"ivfpq_default+rerank", "hybrid_weighted+rerank"} <= set(hybrid["ndcg_at_10"])
    assert "rerank_hybrid_vs_dense" in hybrid
    assert r["index"]["text_bytes_per_document"] > 0
    assert "hybrid on 12 dev queries" in "\n".join(in_process["lines"][:-1])


def test_embeddings_are_cached_and_reused(
    in_process: dict[str, Any], beir: Path, cache: Path
) -> None:
    files = sorted(cache.glob("*.npy"))
    assert [f.name.split("-")[0] for f in files] == ["document", "query"]
    stamps = [f.stat().st_mtime_ns for f in files]
    code, lines = run_eval("--data", str(beir), "--split", "test", "--nprobe", "2")
    assert code == 0
    assert [f.stat().st_mtime_ns for f in sorted(cache.glob("*.npy"))] == stamps
    r = last_json(lines)
    assert r["ndcg_at_10"]["exact"] == 1.0 and set(r["ndcg_at_10"]) == {
        "exact",
        "ivfpq_default",
        "ivfpq_nprobe_2",
        "bm25",
        "hybrid_rrf",
        "hybrid_weighted",
    }
    assert "no --rerank-checkpoint given" in r["rerank"]["skipped"]
    assert "rerank: not measured: no --rerank-checkpoint given" in "\n".join(lines)


def test_bad_input_is_refused_with_the_reason(
    beir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_eval("--data", str(tmp_path), "--split", "test")[0] == 2
    assert "missing corpus.jsonl" in capsys.readouterr().err
    assert run_eval("--data", str(beir), "--split", "dev")[0] == 2
    assert "missing qrels/dev.tsv" in capsys.readouterr().err
    assert run_eval("--data", str(beir), "--split", "test", "--nprobe", "100000")[0] == 2
    assert "must be in 1..nlist" in capsys.readouterr().err


def test_through_a_gateway(
    beir: Path, cache: Path, in_process: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("eval-gateway")
    docs = np.load(next(cache.glob("document-*.npy")))  # the in-process run's embeddings
    index_dir = train_test_index(docs, tmp / "index")
    with run_redis(tmp / "redis") as store, stack_in_background(store.url, index_dir, tmp) as bg:
        code, lines = run_eval(
            "--data", str(beir), "--split", "test", "--gateway", bg.address, "--nprobe", "1"
        )
        assert code == 0, lines
        r = last_json(lines)
        assert r["path"] == "gateway" and r["index"]["ingested"] == N_DOCS
        assert r["ndcg_at_10"]["exact"] == 1.0
        assert r["ndcg_at_10"]["service_default"] >= 0.9
        assert r["ndcg_at_10"]["service_nprobe_1"] >= 0.9
        # every mode as a client asks for it, side by side on the same queries
        for name in ("service_dense", "bm25", "hybrid_rrf", "hybrid_weighted"):
            assert r["ndcg_at_10"][name] >= 0.9, name
        assert r["hybrid"]["queries"] > 0 and set(r["hybrid"]["vs_dense"]) == {
            "bm25",
            "hybrid_rrf",
            "hybrid_weighted",
        }
        # the corpus is in the store now: --no-ingest searches what is there
        code, lines = run_eval(
            "--data", str(beir), "--split", "test", "--gateway", bg.address, "--no-ingest"
        )
        assert code == 0 and "ingested" not in last_json(lines)["index"]
