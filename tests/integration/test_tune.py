"""`gtr-retrieval tune` end to end on a small BEIR folder: a tiny BERT in MiniLM's layout as
the serving encoder, trained as ADE-SPL for one short epoch, the shard's own IVF-PQ and
Tantivy indexes, a CELI reranker on the same tiny BERT trained for a few steps and scored,
the report, the setting, a resumed rerun, a rerun with another budget, and bad input
refused with nothing written."""

from __future__ import annotations

import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from services.cli.main import main
from services.common.retrieval_setting import RetrievalSetting
from services.tune.rollout import rollout_setting
from tests.encoder_fixtures import encoder_base, ensure_tiny_bert, write_beir

pytestmark = pytest.mark.slow  # the whole path twice, a few seconds per stage


def _tune(data: Path, out: Path, *extra: str, model: Path | None = None) -> tuple[int, str, str]:
    models = (
        [] if model is None else ["--serving-encoder", str(model), "--rerank-backbone", str(model)]
    )
    argv = [
        "tune",
        *models,
        "--data",
        str(data),
        "--out",
        str(out),
        "--depth",
        "20",
        "--encoder-epochs",
        "1",
        "--encoder-batch-size",
        "4",
        "--rerank-steps",
        "3",
        "--rerank-max-len",
        "96",
        "--val-fraction",
        "0.25",
        "--encoder-negatives",
        "hybrid",
        "--encoder-negatives",
        "dense",
        "--quiet",
        *extra,
    ]
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        rc = main(argv)
    return rc, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("tune")
    os.environ["GTR_CACHE_DIR"] = str(root / "cache")  # restored below
    data = write_beir(root / "beir", queries=40, docs=80)
    model = ensure_tiny_bert(encoder_base(tmp_path_factory))
    out = root / "out"
    try:
        rc, stdout, stderr = _tune(data, out, "--rerank-budget-ms", "100000", model=model)
    finally:
        os.environ.pop("GTR_CACHE_DIR", None)
    assert rc == 0, stderr
    report = json.loads((out / "report.json").read_text())
    assert json.loads(stdout.strip().splitlines()[-1])["system"] == report["best"]["system"]
    assert report["command"].startswith(f"gtr-retrieval tune --serving-encoder {model}")
    return data, out, report


def test_the_report_has_every_system_side_by_side(tuned: tuple[Path, Path, dict[str, Any]]) -> None:
    _, out, report = tuned
    systems = report["systems"]
    for name in (
        "serving/hybrid-default",
        "bm25",
        "serving/dense",
        "serving/hybrid",
        "serving/exact-dense",
        "ade-spl-hybrid/dense",
        "ade-spl-hybrid/hybrid",
        "ade-spl-hybrid/exact-dense",
    ):
        assert name in systems, name
    reranked = [n for n, s in systems.items() if "+celi-hybrid" in n]
    assert reranked and all(systems[n]["setting"]["rerank_checkpoint"] for n in reranked)
    for name, row in systems.items():
        assert 0.0 <= row["ndcg_at_10"] <= 1.0
        if name != report["serving"]:
            assert set(row["vs_serving"]) >= {"ci95", "wins", "losses", "mean_diff"}
    split = report["split"]
    assert split["dev"] == 8 and split["val"] == 8 and split["train"] == 24
    best = report["best"]
    assert best["system"] in systems and systems[best["system"]]["eligible"]
    assert json.loads((out / "retrieval_setting.json").read_text()) == best["setting"]
    # what a rollout of it records (index rollout --retrieval-setting)
    rollout = RetrievalSetting.load(out / "rollout_setting.json")
    assert rollout == rollout_setting(best["system"], best["setting"])
    assert report["fusion"]["ade-spl-hybrid"]["method"] in ("weighted", "rrf")
    assert report["rerank"]["celi-hybrid"]["depths_within_budget"] == [10, 20]
    (pair,) = [p for p in report["head_to_head"] if p["system"] == "ade-spl-hybrid/hybrid"]
    assert pair["baseline"] == "ade-spl-dense/hybrid" and "ci95" in pair


def test_the_trainers_held_out_validation_and_dev_and_mined_the_hybrid_run(
    tuned: tuple[Path, Path, dict[str, Any]],
) -> None:
    _, out, _ = tuned
    split = json.loads((out / "split.json").read_text())
    manifest = json.loads((out / "encoders" / "ade-spl-hybrid" / "manifest.json").read_text())
    recipe = manifest["recipe"]
    assert recipe["negatives_file"] == str(out / "runs" / "serving-hybrid.json")
    assert recipe["holdout_queries"] == len(split["val"])
    rerank_split = json.loads((out / "rerankers" / "celi-hybrid" / "split.json").read_text())
    assert set(rerank_split["train"]) == set(split["train"])
    assert rerank_split["dev"] == split["dev"]
    config = json.loads((out / "rerankers" / "celi-hybrid" / "celi_config.json").read_text())
    assert config["training"]["config"]["negatives_file"] == str(
        out / "runs" / "best-first-stage.json"
    )


def test_a_rerun_trains_nothing_again_and_another_budget_re_chooses(
    tuned: tuple[Path, Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    data, out, report = tuned
    model = ensure_tiny_bert(encoder_base(tmp_path_factory))
    weights = out / "rerankers" / "celi-hybrid" / "celi_head.safetensors"
    stamp = weights.stat().st_mtime_ns
    os.environ["GTR_CACHE_DIR"] = str(out.parent / "cache")
    try:
        # the CPU table's depth 10 costs 510 ms: a 200 ms budget fits no rerank
        rc, _, stderr = _tune(data, out, "--rerank-budget-ms", "200", model=model)
    finally:
        os.environ.pop("GTR_CACHE_DIR", None)
    assert rc == 0, stderr
    assert weights.stat().st_mtime_ns == stamp
    again = json.loads((out / "report.json").read_text())
    assert again["rerank"]["celi-hybrid"]["depths_within_budget"] == []
    assert again["best"]["system"] == again["best_without_rerank"]["system"]
    assert again["systems"]["bm25"] == report["systems"]["bm25"]


def test_rollout_only_when_warranted(
    tuned: tuple[Path, Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--rollout runs `index rollout` only when the report says the best system is better
    than the serving one; here it is asked against a run directory with no stack, so a
    warranted rollout fails to find the store (exit 2) and an unwarranted one exits 3."""
    data, out, _ = tuned
    model = ensure_tiny_bert(encoder_base(tmp_path_factory))
    setting = json.loads((out / "rollout_setting.json").read_text())
    assert setting["version"] == 1 and setting["fusion"]["method"] in ("weighted", "rrf")
    os.environ["GTR_CACHE_DIR"] = str(out.parent / "cache")
    try:
        rc, _, stderr = _tune(
            data, out, "--rollout", "--run-dir", str(out.parent / "no-stack"), model=model
        )
    finally:
        os.environ.pop("GTR_CACHE_DIR", None)
    plan = json.loads((out / "report.json").read_text())["rollout"]
    if plan["warranted"]:
        assert rc == 2 and "no-stack" in stderr
    else:
        assert rc == 3 and f"not rolled out: {plan['reason']}" in stderr


def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    data = tmp_path / "beir"
    data.mkdir()
    (data / "corpus.jsonl").write_text("")
    (data / "queries.jsonl").write_text("")
    rc, _, stderr = _tune(data, tmp_path / "out")
    assert rc == 2 and "qrels/train.tsv" in stderr
    assert not (tmp_path / "out").exists()
