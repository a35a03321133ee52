"""`gtr-retrieval tune`'s pieces without models: the split, the choices, the checks, the
run files the trainers mine negatives from (the whole path: tests/integration/test_tune.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from services.common.errors import InvalidArgument, NotFound
from services.common.fusion import Method
from services.corpus.beir import split_queries
from services.corpus.runs import read_run
from services.tune.choice import choose_fusion, choose_rerank, interpolate
from services.tune.config import CONFIG_FILE, TuneConfig, validate
from services.tune.lists import Lists
from services.tune.splits import make_split
from tests.encoder_fixtures import write_beir


def _qrels(n: int) -> dict[str, dict[str, int]]:
    return {f"q{i}": {f"d{i}": 1} for i in range(n)}


def test_dev_is_the_trainers_split_and_validation_is_held_out_of_train() -> None:
    qrels = _qrels(100)
    split = make_split(qrels, seed=13, dev_fraction=0.2, val_fraction=0.15)
    _, trainers_dev = split_queries(sorted(qrels), 13, 0.2)
    assert list(split.dev) == trainers_dev
    assert len(split.val) == round(80 * 0.15)
    assert not set(split.val) & set(split.train)
    assert not set(split.val) & set(split.dev)
    assert set(split.train) | set(split.val) | set(split.dev) == set(qrels)
    assert make_split(qrels, 13, 0.2, 0.15) == split
    assert make_split(qrels, 14, 0.2, 0.15).dev != split.dev


def test_too_few_judged_queries_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="at least 3"):
        make_split(_qrels(2), 13, 0.2, 0.15)


def test_interpolation_weight_one_is_the_rerankers_order_and_zero_the_first_stage() -> None:
    first = [("a", 1.0), ("b", 0.5), ("c", 0.0), ("tail", -1.0)]
    rerank = {"a": 0.0, "b": 1.0, "c": 2.0}
    assert interpolate(first, rerank, 3, 1.0) == ["c", "b", "a", "tail"]
    assert interpolate(first, rerank, 3, 0.0) == ["a", "b", "c", "tail"]
    # a: 0.5*0 + 0.5*1 = .5, b: .5*.5 + .5*.5 = .5, c: .5*1 + .5*0 = .5 -> ties keep order
    assert interpolate(first, rerank, 3, 0.5) == ["a", "b", "c", "tail"]
    # depth 2: c is not reranked and stays after the reranked head
    assert interpolate(first, rerank, 2, 1.0) == ["b", "a", "c", "tail"]


def test_interpolation_uses_min_max_normalised_scores() -> None:
    # the rerank scores span 1000x the first stage's: normalised, both still count
    first = [("a", 1.0), ("b", 0.0), ("c", 0.4)]
    rerank = {"a": 0.0, "b": 1000.0, "c": 700.0}
    # a: .6*0 + .4*1 = .4; b: .6*1 + 0 = .6; c: .6*.7 + .4*.4 = .58
    assert interpolate(first, rerank, 3, 0.6) == ["b", "c", "a"]


def _lists(dense: dict[str, list[str]], sparse: dict[str, list[str]]) -> Lists:
    def scored(run: dict[str, list[str]]) -> dict[str, list[tuple[str, float]]]:
        return {q: [(d, 1.0 - r / 10) for r, d in enumerate(v)] for q, v in run.items()}

    return Lists(scored(dense), scored(sparse), {q: list(v) for q, v in dense.items()})


def test_fusion_choice_keeps_the_gateway_default_on_a_tie() -> None:
    same = {"q": ["rel", "x", "y"]}
    choice, grid = choose_fusion(_lists(same, same), {"q": {"rel": 1}}, ["q"], depth=3)
    assert choice.fusion.method is Method.WEIGHTED and choice.fusion.dense_weight == 0.5
    assert len(grid) > 10


def test_fusion_choice_follows_the_validation_queries() -> None:
    # the relevant document is first in BM25 and last in dense: the default ties it with x
    dense = {"q": ["x", "y", "z", "rel"]}
    sparse = {"q": ["rel", "w", "v", "u"]}
    choice, _ = choose_fusion(_lists(dense, sparse), {"q": {"rel": 1}}, ["q"], depth=4)
    assert choice.val_ndcg_at_10 == pytest.approx(1.0)
    assert choice.fusion.method is Method.RRF or choice.fusion.dense_weight < 0.5


def test_rerank_choice_only_among_the_depths_given() -> None:
    first = {"q": [("x", 0.9), ("y", 0.8), ("rel", 0.7)]}
    scores = {"q": {"x": 0.0, "y": 0.1, "rel": 5.0}}
    choice, _ = choose_rerank(first, scores, {"q": {"rel": 1}}, ["q"], [2])
    assert choice is not None and choice.depth == 2
    choice, _ = choose_rerank(first, scores, {"q": {"rel": 1}}, ["q"], [2, 3])
    assert choice is not None and choice.depth == 3 and choice.val_ndcg_at_10 == 1.0
    assert choose_rerank(first, scores, {"q": {"rel": 1}}, ["q"], [])[0] is None


def test_a_run_file_must_cover_the_queries(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"q1": ["d1", "gone", "d2"]}))
    assert read_run(path, ["q1"], {"d1", "d2"}) == {"q1": ["d1", "d2"]}
    with pytest.raises(InvalidArgument, match="no list for 1 queries"):
        read_run(path, ["q1", "q2"], {"d1"})
    path.write_text("[1, 2]")
    with pytest.raises(InvalidArgument, match="expected"):
        read_run(path, ["q1"], {"d1"})


def test_bad_requests_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    data = write_beir(tmp_path / "beir", queries=10, docs=20)
    out = tmp_path / "out"
    for bad, match in (
        (TuneConfig(tmp_path / "nowhere", out), "no corpus.jsonl"),
        (TuneConfig(data, out, encoders=("bert",)), "unknown encoder architecture"),
        (TuneConfig(data, out, rerankers=("bm25",)), "unknown negative source"),
        (TuneConfig(data, out, val_fraction=1.0), "validation fraction"),
        (TuneConfig(data, out, depth_table=tmp_path / "missing.json"), "no rerank depth table"),
    ):
        with pytest.raises((InvalidArgument, NotFound), match=match):
            validate(bad)
        assert not out.exists()
    with pytest.raises(NotFound, match="no SLO"):
        validate(TuneConfig(data, out, size="huge"))


def test_a_run_folder_resumes_only_with_the_same_settings(tmp_path: Path) -> None:
    data = write_beir(tmp_path / "beir", queries=10, docs=20)
    out = tmp_path / "out"
    out.mkdir()
    cfg = TuneConfig(data, out)
    (out / CONFIG_FILE).write_text(json.dumps(cfg.recorded()))
    validate(cfg)
    validate(TuneConfig(data, out, rerankers=("hybrid", "dense"), threads=1))  # may add one
    with pytest.raises(InvalidArgument, match="encoder_epochs"):
        validate(TuneConfig(data, out, encoder_epochs=1.0))
    (out / CONFIG_FILE).unlink()
    (out / "other").write_text("x")
    with pytest.raises(InvalidArgument, match="not a tune run"):
        validate(cfg)


def _report(best: str, low: float | None, setting: Mapping[str, object]) -> dict[str, object]:
    return {
        "serving": "serving/hybrid-default",
        "best": {"system": best, "paired_low_vs_serving": low, "setting": setting},
    }


def test_a_rollout_is_warranted_only_above_zero_and_carries_encoder_and_setting(
    tmp_path: Path,
) -> None:
    from services.tune.rollout import rollout_plan

    setting_file = tmp_path / "rollout_setting.json"
    tuned = {
        "encoder": str(tmp_path / "encoders" / "ade-spl-hybrid"),
        "rerank_checkpoint": str(tmp_path / "rerankers" / "celi-hybrid"),
    }
    plan = rollout_plan(_report("x/hybrid+celi-hybrid", 0.012, tuned), tmp_path, setting_file)
    assert plan["warranted"]
    assert plan["argv"] == [
        "index",
        "rollout",
        "--encoder",
        tuned["encoder"],
        "--retrieval-setting",
        str(setting_file),
        "--yes",
    ]
    assert f"--checkpoint-dir {tmp_path / 'rerankers'}" in plan["reranker"]
    for low in (0.0, -0.01, None):
        assert not rollout_plan(_report("x/hybrid", low, tuned), tmp_path, setting_file)[
            "warranted"
        ]
    same = rollout_plan(_report("serving/hybrid-default", 0.5, {}), tmp_path, setting_file)
    assert not same["warranted"] and "serving now" in same["reason"]
    # the serving encoder with a better setting: a new generation by --retrain
    retrain = rollout_plan(
        _report("serving/hybrid", 0.01, {"encoder": None}), tmp_path, setting_file
    )
    assert retrain["warranted"] and retrain["argv"][2] == "--retrain"
