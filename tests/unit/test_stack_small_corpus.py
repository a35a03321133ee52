"""``up --corpus`` with a small corpus: the first run's training fits the corpus (fewer PQ
bits below 256 documents, docs/index.md "Training") instead of dying in FAISS's k-means,
and a corpus too small to train on at all is one ``error:`` line and exit 2 before
anything starts (no child process, no run directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.domain import Document
from services.common.errors import InvalidArgument
from services.index.core.trained import Manifest
from services.stack import first_run
from services.stack.config import StackConfig
from tests.support.shards import scifact_vectors

ROOT = Path(__file__).resolve().parents[2]


def test_the_first_run_trains_on_200_documents_with_7_bit_codes(
    scifact_dir: Path, tmp_path: Path
) -> None:
    # 200 vectors used to end in FAISS's "Number of training points (200) should be at
    # least as large as number of clusters (256)": 8-bit PQ codes have 256 centroids
    vectors = scifact_vectors(scifact_dir)[:200]
    docs = [Document(str(i), f"text {i}") for i in range(len(vectors))]
    emb = first_run.CorpusEmbeddings(tmp_path / "c.jsonl", docs, vectors, "all-MiniLM-L6-v2")
    cfg = StackConfig(run_dir=tmp_path / "run", progress=False)
    said: list[str] = []
    manifest = first_run.train_on(cfg, emb, said.append)
    assert Manifest.read(cfg.index_dir).pq_bits == manifest.pq_bits == 7
    assert manifest.factory.startswith("IVF5,PQ96x7")
    assert manifest.measured_recall is not None and manifest.measured_recall >= 0.99
    assert manifest.ivf_advice is not None  # and it is told a flat index would do


def test_up_refuses_a_corpus_too_small_to_train_on_in_one_line_before_starting_anything(
    tmp_path: Path,
) -> None:
    corpus = tmp_path / "one.jsonl"
    corpus.write_text(json.dumps({"_id": "a", "title": "t", "text": "x"}) + "\n", "utf-8")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = ["up", "--corpus", str(corpus), "--run-dir", str(run_dir), "--encoder", "inprocess"]
    done = subprocess.run(
        [sys.executable, "-m", "services.cli.main", *argv, "--no-serve"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: --corpus {corpus} has 1 document(s): training the index on the first run "
        "needs at least 2"
    ]
    assert not run_dir.exists()  # nothing started, nothing written


def test_two_documents_pass_the_check(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"_id": str(i), "text": "x"}) + "\n" for i in (1, 2)))
    first_run.check_trainable(StackConfig(run_dir=tmp_path / "run", corpus=corpus))
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"_id": "1", "text": "x"}) + "\n")
    with pytest.raises(InvalidArgument, match="has 1 document"):
        first_run.check_trainable(StackConfig(run_dir=tmp_path / "run", corpus=one))
