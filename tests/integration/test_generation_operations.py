"""What ``index rollout | retire | generations`` decide (services/generations/operations.py)
on a real Redis: when a rollout's CPU budget starts around the publish of its encoder (a
whole rollout run by the real builder, with the encoder stand-in of
tests/support/hash_store.py), whether a recorded rollout in phase ``publish`` publishes
again, which generations are displaced, which one a retire means, and the typed record
``index generations --json`` prints."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.common.encoder_spec import EncoderSpec
from services.common.errors import FailedPrecondition, NotFound
from services.encoder.base import Encoder
from services.generations.builder import RolloutBuilder, RolloutOptions
from services.generations.operations import (
    displaced,
    intend_rollout,
    plan_of,
    retire_choice,
    run_rollout,
    status,
)
from services.generations.registry import Generation, Registry
from services.generations.state import RecordedPlan, RolloutState, RolloutStore
from services.index.keys import CPU_BUDGET_KEY
from tests.support.hash_store import DIM, SPEC, HashEncoder, g1_store, hash_encoders

NEW = EncoderSpec("embed", 2, DIM, "hash-v2", "hash")
BUDGET = frozenset({0})


@pytest.fixture
def store(redis_url: str, tmp_path: Path) -> Iterator[Any]:
    client = g1_store(redis_url, tmp_path)
    yield client
    client.close()


def _budget(client: Any) -> str | None:
    raw = client.get(CPU_BUDGET_KEY)
    return None if raw is None else raw.decode()


class _Seen:
    """The CPU budget recorded in Redis when the publish ran and when the builder first
    opened an encoder (the train phase, after the publish)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.at_publish: list[tuple[str | None, frozenset[int] | None]] = []
        self.at_encode: list[str | None] = []

    def publish(
        self, folder: str, cpus: frozenset[int] | None, int8_unmeasured: bool
    ) -> EncoderSpec:
        self.at_publish.append((_budget(self.client), cpus))
        return NEW

    async def encoders(self, spec: EncoderSpec) -> Encoder:
        self.at_encode.append(_budget(self.client))
        return HashEncoder()


def _rollout(client: Any, tmp_path: Path, seen: _Seen, encoder: Path | None) -> Generation:
    def make(publisher: Any = None) -> RolloutBuilder:
        options = RolloutOptions(index_root=tmp_path, batch=8, sample=40, wait_for_shards=False)
        return RolloutBuilder(client, seen.encoders, options, publisher=publisher)

    intent = intend_rollout(make(), plan_of(encoder, None, False))
    return run_rollout(
        make, intent, budget=BUDGET, client=client, triton_repo=None, publish=seen.publish
    )


def test_a_rollout_that_publishes_starts_its_cpu_budget_after_the_publish(
    store: Any, tmp_path: Path
) -> None:
    seen = _Seen(store)
    (tmp_path / "checkpoint").mkdir()
    serving = _rollout(store, tmp_path, seen, tmp_path / "checkpoint")
    assert seen.at_publish == [(None, BUDGET)]  # every CPU for the export and the load
    assert seen.at_encode and set(seen.at_encode) == {"0"}  # the budget from then on
    assert (serving.name, serving.encoder) == ("g2", NEW)
    assert _budget(store) is None  # ended with the rollout


def test_a_rollout_without_a_publish_holds_its_budget_from_the_start(
    store: Any, tmp_path: Path
) -> None:
    seen = _Seen(store)
    serving = _rollout(store, tmp_path, seen, None)
    assert seen.at_publish == [] and set(seen.at_encode) == {"0"}
    assert (serving.name, serving.encoder) == ("g2", SPEC)


@pytest.mark.parametrize(("phase", "publishing"), [("publish", True), ("bulk", False)])
def test_a_recorded_rollout_publishes_again_only_when_it_stopped_publishing(
    store: Any, tmp_path: Path, phase: str, publishing: bool
) -> None:
    RolloutStore(store).start(
        RolloutState(
            target="g2",
            source="g1",
            phase=phase,
            plan=RecordedPlan(None if phase == "publish" else NEW, 2, False, "/ckpt"),
            host=socket.gethostname(),
            pid=2**22 + 7,  # no such process: its builder is gone
        )
    )
    builder = RolloutBuilder(store, hash_encoders, RolloutOptions(index_root=tmp_path))
    intent = intend_rollout(builder, plan_of(None, None, False))
    assert intent.resumes is not None and intent.resumes.phase == phase
    assert intent.publishing is publishing


@pytest.mark.parametrize(
    ("recorded", "asked", "published"),
    [(True, False, True), (False, True, True), (False, False, False)],
)
def test_a_resumed_publish_serves_int8_unmeasured_when_the_plan_or_the_resume_asked(
    store: Any, tmp_path: Path, recorded: bool, asked: bool, published: bool
) -> None:
    """A rollout started with --int8-unmeasured and stopped while publishing publishes the
    same way when resumed without the flag; a resume may add it."""
    RolloutStore(store).start(
        RolloutState(
            target="g2",
            source="g1",
            phase="publish",
            plan=RecordedPlan(None, 2, False, "/ckpt", int8_unmeasured=recorded),
            host=socket.gethostname(),
            pid=2**22 + 7,  # no such process: its builder is gone
        )
    )
    seen: list[bool] = []

    def publisher(folder: str, int8_unmeasured: bool) -> EncoderSpec:
        seen.append(int8_unmeasured)
        raise FailedPrecondition("stop here")  # a refused publish ends the rollout

    options = RolloutOptions(index_root=tmp_path)
    builder = RolloutBuilder(store, hash_encoders, options, publisher=publisher)
    with pytest.raises(FailedPrecondition, match="stop here"):
        asyncio.run(builder.rollout(plan_of(None, None, False, None, asked)))
    assert seen == [published]


def test_displaced_names_a_previous_generation_no_rollback_reaches(store: Any) -> None:
    registry = Registry(store)
    assert displaced(registry) == []
    registry.put(Generation("g2", "previous", 2, SPEC, "/idx/g2"))
    registry.put(Generation("g3", "retired", 2, SPEC, "/idx/g3"))
    assert [g.name for g in displaced(registry)] == ["g2"]


def test_retire_means_the_previous_generation_and_an_unknown_one_is_refused(
    store: Any,
) -> None:
    registry = Registry(store)
    assert retire_choice(registry, None) is None  # none: the retire itself says so
    with pytest.raises(NotFound):
        retire_choice(registry, "g9")
    assert retire_choice(registry, "g1") == "g1"


def test_status_prints_the_rollout_as_its_typed_record(store: Any) -> None:
    RolloutStore(store).start(
        RolloutState(
            target="g2", source="g1", phase="bulk", p0={0: "1-0"}, positions={0: "2-0"}, done=8
        )
    )
    listed = json.loads(json.dumps(status(store).to_json()))
    rollout = listed["rollout"]
    assert (rollout["phase"], rollout["done"], rollout["positions"]) == ("bulk", 8, {"0": "2-0"})
    assert rollout["cursor"] == {"node": 0, "cursor": 0, "nodes": 0, "finished": False}
    assert [row["name"] for row in listed["generations"]] == ["g1"]
    assert listed["generations"][0]["alias"] == "serving"
