"""A generation's retrieval setting (issue #35): its validation, its JSON (the file and the
record's field), old records without it, and the rerank interpolation and plan the gateway
derives from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.deadline import Deadline
from services.common.domain import Hit
from services.common.errors import InvalidArgument, NotFound
from services.common.fusion import Fusion, Method, Mode, RetrievalDefaults
from services.common.retrieval_setting import (
    RetrievalSetting,
    check_checkpoint_name,
    interpolated_order,
)
from services.gateway.domain import SearchQuery
from services.gateway.reranking import interpolate, rerank_plan
from services.generations.state import RecordedPlan, RolloutState
from services.index.records import EncoderSpec, Generation
from services.tune import choice

SETTING = RetrievalSetting(
    fusion=Fusion(Method.RRF, rrf_k=20),
    candidates=50,
    rerank_checkpoint="celi-hybrid",
    rerank_weight=0.7,
    rerank_depth=30,
    note="tuned on dev",
)

# A record as the releases before the setting wrote it (no "retrieval" key).
OLD_RECORD = json.dumps(
    {
        "name": "g1",
        "state": "serving",
        "num_shards": 2,
        "encoder": {
            "model": "all-MiniLM-L6-v2",
            "version": 0,
            "dim": 384,
            "digest": "",
            "source": "",
        },
        "index_dir": "/idx",
        "params": {"nprobe": 8},
        "created_at": 1.0,
        "serving_since": 2.0,
        "switch_in": {"0": "5-0"},
        "note": "",
    },
    sort_keys=True,
)


# --- the record ---------------------------------------------------------------------------


def test_a_record_written_before_the_setting_loads_without_one_and_writes_back_the_same() -> None:
    gen = Generation.from_json(OLD_RECORD)
    assert gen.retrieval is None and gen.params == {"nprobe": 8}
    assert json.loads(gen.to_json()) == json.loads(OLD_RECORD)  # no "retrieval" key added


def test_a_record_with_a_setting_round_trips() -> None:
    gen = Generation("g2", "building", 3, EncoderSpec("embed", 2, 384), "/i", retrieval=SETTING)
    raw = gen.to_json()
    assert json.loads(raw)["retrieval"]["fusion"] == {
        "method": "rrf",
        "rrf_k": 20,
        "dense_weight": 0.5,
    }
    assert Generation.from_json(raw) == gen


def test_the_rollout_plan_records_the_setting_and_an_old_plan_reads_without_one() -> None:
    plan = RecordedPlan(EncoderSpec("embed", 2, 384), 2, False, "", SETTING)
    assert RecordedPlan.load(plan.dump()) == plan
    old = json.dumps({"encoder": None, "shards": 2, "retrain": True, "encoder_dir": ""})
    assert RecordedPlan.load(old) == RecordedPlan(None, 2, True, "")
    # the running rollout as `index generations --json` prints it: the plan's setting too
    state = RolloutState(target="g2", source="g1", plan=plan)
    shown = json.loads(json.dumps(state.to_json()))
    assert shown["plan"]["retrieval"]["rerank_checkpoint"] == "celi-hybrid"
    assert RolloutState.from_fields(state.to_fields()).plan == plan


# --- the setting and its file -------------------------------------------------------------


def test_the_json_round_trips_and_fields_left_out_take_their_defaults(tmp_path: Path) -> None:
    assert RetrievalSetting.from_json(SETTING.to_json()) == SETTING
    path = SETTING.write(tmp_path / "setting.json")
    assert RetrievalSetting.load(path) == SETTING
    bare = RetrievalSetting.from_json('{"fusion": {"method": "weighted", "dense_weight": 0.3}}')
    assert bare == RetrievalSetting(fusion=Fusion(Method.WEIGHTED, dense_weight=0.3))
    assert bare.rerank_weight == 1.0 and bare.rerank_depth == 0 and bare.candidates == 100


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('{"candidates": 0}', "candidates"),
        ('{"candidates": 1001}', "candidates"),
        ('{"candidates": 10.5}', "candidates"),
        ('{"rerank_weight": 1.5}', "rerank_weight"),
        ('{"rerank_weight": "1"}', "rerank_weight"),
        ('{"rerank_depth": -1}', "rerank_depth"),
        ('{"fusion": {"method": "max"}}', "fusion.method"),
        ('{"fusion": {"rrf_k": 0}}', "rrf_k"),
        ('{"fusion": {"dense_weight": -0.1}}', "dense_weight"),
        ('{"fusion": {"weight": 0.1}}', "fusion"),
        ('{"fusoin": {}}', "unknown field 'fusoin'"),
        ('{"version": 2}', "version 2"),
        ('{"rerank_checkpoint": "../etc"}', "'../etc'"),
        ("[1, 2]", "JSON object"),
        ("{", "not JSON"),
    ],
)
def test_a_bad_setting_is_refused_naming_what_is_wrong(text: str, names: str) -> None:
    with pytest.raises(InvalidArgument, match=names.replace(".", r"\.").replace("(", r"\(")):
        RetrievalSetting.from_json(text)


def test_a_file_error_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="no such retrieval setting file"):
        RetrievalSetting.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"candidates": 0}')
    with pytest.raises(InvalidArgument, match=f"{bad}: retrieval setting candidates"):
        RetrievalSetting.load(bad)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "/abs", ".hidden", "a\\b", "x" * 129])
def test_a_checkpoint_name_cannot_leave_the_checkpoint_directory(name: str) -> None:
    with pytest.raises(InvalidArgument):
        check_checkpoint_name(name)


@pytest.mark.parametrize("name", ["celi", "celi-hybrid_v2.1", "9"])
def test_a_plain_directory_name_is_a_checkpoint_name(name: str) -> None:
    assert check_checkpoint_name(name) == name


def test_the_setting_gives_the_gateway_its_fusion_and_candidates_not_its_mode() -> None:
    assert SETTING.defaults(Mode.DENSE) == RetrievalDefaults(Mode.DENSE, SETTING.fusion, 50)


# --- the rerank the gateway derives from it ----------------------------------------------


def _answer(*pairs: tuple[float, float]) -> tuple[list[Hit], list[Hit]]:
    """(candidates in first-stage order, the reranker's answer): the candidates "a", "b",
    ... each (rerank score, first-stage score); the answer is them best rerank score
    first, ``score`` the reranker's."""
    candidates = [Hit(chr(97 + i), f, 0, f) for i, (_, f) in enumerate(pairs)]
    scored = [
        Hit(h.id, r, 0, h.first_stage_score) for h, (r, _) in zip(candidates, pairs, strict=True)
    ]
    return candidates, sorted(scored, key=lambda h: -h.score)


def test_weight_one_keeps_the_rerankers_order_and_scores() -> None:
    candidates, answer = _answer((1.0, 0.9), (3.0, 0.5), (2.0, 0.1))
    assert interpolate(candidates, answer, 1.0) == answer
    assert [h.id for h in answer] == ["b", "c", "a"]


def test_weight_zero_is_the_first_stage_order() -> None:
    candidates, answer = _answer((1.0, 0.9), (3.0, 0.5), (2.0, 0.1))
    assert [h.id for h in interpolate(candidates, answer, 0.0)] == ["a", "b", "c"]


def test_the_mix_is_over_min_max_normalised_scores() -> None:
    # rerank 10, 6, 0 -> 1, 0.6, 0; first stage 0.2, 0.6, 1.0 -> 0, 0.5, 1
    candidates, answer = _answer((10.0, 0.2), (6.0, 0.6), (0.0, 1.0))
    mixed = interpolate(candidates, answer, 0.5)
    assert [h.id for h in mixed] == ["b", "a", "c"]
    assert [h.score for h in mixed] == pytest.approx([0.55, 0.5, 0.5])
    assert [h.first_stage_score for h in mixed] == [0.6, 0.2, 1.0]  # kept as they came


def test_ties_keep_the_first_stage_order_as_tune_does() -> None:
    # a and c tie at 0.5 (see above); c is before a in first-stage order here
    candidates, answer = _answer((0.0, 1.0), (6.0, 0.6), (10.0, 0.2))
    assert [h.id for h in interpolate(candidates, answer, 0.5)] == ["b", "a", "c"]
    assert choice.interpolate(
        [(h.id, h.first_stage_score) for h in candidates],
        {h.id: h.score for h in answer},
        3,
        0.5,
    ) == ["b", "a", "c"]


def test_equal_scores_in_one_list_leave_the_order_to_the_other() -> None:
    candidates, answer = _answer((1.0, 0.2), (1.0, 0.9))
    assert [h.id for h in interpolate(candidates, answer, 0.8)] == ["b", "a"]
    assert interpolate([], [], 0.5) == []
    assert interpolated_order([], [], 0.5) == []
    with pytest.raises(ValueError):
        interpolated_order([1.0], [], 0.5)


class TableReranker:
    """Only the depth table of a reranker (what a plan asks of it)."""

    async def rerank(self, *args: object, **kw: object) -> list[Hit]:
        raise AssertionError("a plan does not rerank")

    def depth_for_budget(self, budget_ms: float) -> int:
        return 20


def _plan(q: SearchQuery, setting: RetrievalSetting | None):  # type: ignore[no-untyped-def]
    return rerank_plan(q, Deadline.after(10.0), TableReranker(), lambda: 0.0, setting)


def test_the_plan_takes_the_generations_checkpoint_weight_and_depth() -> None:
    plan = _plan(SearchQuery("q", 10, rerank=True), SETTING)
    assert (plan.depth, plan.source, plan.checkpoint, plan.weight) == (
        30,
        "setting",
        "celi-hybrid",
        0.7,
    )
    assert plan.estimated  # out of time: skipped, not an error


def test_the_requests_depth_wins_and_without_a_setting_the_table_decides() -> None:
    named = _plan(SearchQuery("q", 10, rerank=True, rerank_depth=40), SETTING)
    assert (named.depth, named.source, named.checkpoint) == (40, "request", "celi-hybrid")
    table = _plan(SearchQuery("q", 10, rerank=True), None)
    assert (table.depth, table.source, table.checkpoint, table.weight) == (20, "table", "", 1.0)


def test_a_generation_depth_below_k_is_raised_to_k() -> None:
    shallow = RetrievalSetting(rerank_depth=5)
    assert _plan(SearchQuery("q", 10, rerank=True), shallow).depth == 10


def test_no_rerank_asked_no_plan_whatever_the_setting() -> None:
    assert _plan(SearchQuery("q", 10), SETTING).depth == 0


# --- index rollout --retrieval-setting ------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "no such retrieval setting file"),
        ('{"fusion": {"method": "rrf", "rrf_k": 0}}', "rrf_k: 0 is out of range"),
        ('{"candidate": 10}', "unknown field 'candidate'"),
    ],
)
def test_rollout_refuses_a_bad_setting_file_in_one_line_before_reaching_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, says: str
) -> None:
    from services.cli.main import main

    path = tmp_path / "setting.json"
    if content is not None:
        path.write_text(content)
    # a Redis nobody listens on: reaching it would fail otherwise (UNAVAILABLE)
    where = ["--redis-url", "redis://127.0.0.1:9/0", "--yes", "--quiet"]
    status = main(["index", "rollout", "--retrieval-setting", str(path), *where])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --retrieval-setting {path}") and says in err[0]


# --- what tune's best system gives a rollout ------------------------------------------------


def test_tunes_best_reranked_hybrid_becomes_the_generations_setting(tmp_path: Path) -> None:
    from services.tune.rollout import rollout_setting

    best = {
        "encoder": "/runs/tune/encoders/ade-spl-hybrid",
        "mode": "hybrid",
        "fusion": {"method": "rrf", "candidates": 50, "rrf_k": 20, "val_ndcg_at_10": 0.8},
        "rerank_checkpoint": "/runs/tune/rerankers/celi-hybrid",
        "rerank_depth": 20,
        "rerank_weight": 0.6,
    }
    setting = rollout_setting("ade-spl-hybrid/hybrid+celi-hybrid", best)
    assert setting == RetrievalSetting(
        fusion=Fusion(Method.RRF, rrf_k=20),
        candidates=50,
        rerank_checkpoint="celi-hybrid",
        rerank_weight=0.6,
        rerank_depth=20,
        note="gtr-retrieval tune: best system ade-spl-hybrid/hybrid+celi-hybrid",
    )
    assert RetrievalSetting.load(setting.write(tmp_path / "rollout_setting.json")) == setting


def test_a_dense_best_system_keeps_the_default_fusion_and_says_the_mode() -> None:
    from services.tune.rollout import rollout_setting

    setting = rollout_setting("serving/dense", {"encoder": None, "mode": "dense"})
    assert setting.fusion == Fusion(Method.WEIGHTED) and setting.candidates == 100
    assert "mode dense" in setting.note and setting.rerank_checkpoint == ""
