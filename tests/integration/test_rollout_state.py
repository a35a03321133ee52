"""The rollout's record through the real store (services/generations/state.py) on a real
Redis: whatever :class:`RolloutState` the builder saves reads back equal, with its format
version; a hash an older builder wrote (no ``version``, ``kind`` or ``mode``; a few
fields) still reads, with the defaults a resume needs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.encoder_spec import EncoderSpec
from services.generations.registry import Registry
from services.generations.state import (
    FORMAT_VERSION,
    PHASES,
    RecordedPlan,
    RolloutState,
    RolloutStore,
    ScanCursor,
)
from services.index.keys import ROLLOUT_KEY
from services.process.redis_client import sync_client


@pytest.fixture
def client(redis_url: str) -> Iterator[Any]:
    c = sync_client(redis_url)
    yield c
    c.close()


names = st.text("abcdefgh0123456789-_", min_size=1, max_size=12)
position = st.builds(lambda ms, seq: f"{ms}-{seq}", st.integers(0, 2**48), st.integers(0, 99))
shards = st.integers(0, 7)
times = st.floats(0, 4e9, allow_nan=False, allow_infinity=False)
specs = st.builds(
    EncoderSpec, st.just("embed"), st.integers(0, 20), st.integers(0, 1024), names, names
)
plans = st.builds(RecordedPlan, st.none() | specs, st.integers(0, 64), st.booleans(), names)
cursors = st.builds(
    ScanCursor, st.integers(0, 5), st.integers(0, 2**40), st.integers(0, 6), st.booleans()
)
states = st.builds(
    RolloutState,
    target=names,
    source=names,
    kind=st.sampled_from(["rollout", "rollback"]),
    mode=st.sampled_from(["encode", "retrain", "replay"]),
    phase=st.sampled_from([*PHASES, "done"]),
    plan=st.none() | plans,
    started_at=times,
    owner=names,
    host=names,
    pid=st.none() | st.integers(1, 2**22),
    beat=times,
    target_state=st.sampled_from(["", "previous", "serving"]),
    p0=st.dictionaries(shards, position, max_size=4),
    positions=st.dictionaries(shards, position, max_size=4),
    replayed=st.dictionaries(shards, st.integers(0, 10**9), max_size=4),
    added0=st.dictionaries(shards, st.integers(0, 10**9), max_size=4),
    cursor=cursors,
    done=st.integers(0, 10**9),
    total=st.integers(0, 10**9),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(state=states)
def test_a_saved_state_reads_back_equal_with_its_format_version(client: Any, state: Any) -> None:
    store = RolloutStore(client)
    client.delete(ROLLOUT_KEY)
    started = store.start(state)
    assert started == state
    assert store.load() == state
    assert client.hget(ROLLOUT_KEY, "version") == str(FORMAT_VERSION).encode()
    # save() moves the progress on and leaves who runs it (owner, host, pid, beat) alone
    claimed = store.claim(state, state.owner)
    moved = claimed.with_(phase="switch", done=state.done + 1, positions={0: "9-9"})
    store.save(moved.with_(beat=1.0, host="elsewhere"))
    assert store.load() == moved
    assert json.loads(json.dumps(state.to_json(), sort_keys=True))["target"] == state.target


def test_a_record_an_older_builder_wrote_still_reads(client: Any) -> None:
    """Fields of the release before the typed record: no version, kind or mode."""
    spec: dict[str, Any] = {
        "model": "embed",
        "version": 1,
        "dim": 384,
        "digest": "minilm",
        "source": "",
    }
    client.hset(
        ROLLOUT_KEY,
        mapping={
            "target": "g2",
            "source": "g1",
            "phase": "bulk",
            "owner": "old-builder",
            "host": "pod-0",
            "pid": "41",
            "beat": "1700000000.5",
            "plan": json.dumps({"encoder": spec, "shards": 3, "retrain": False}),
            "p0": json.dumps({"0": "5-0", "1": "7-1"}),
            "positions": json.dumps({"0": "6-0", "1": "7-1"}),
            "cursor": json.dumps({"node": 0, "cursor": 17, "nodes": 1, "finished": False}),
            "done": "64",
        },
    )
    state = RolloutStore(client).load()
    assert state is not None
    assert (state.version, state.kind, state.mode, state.phase) == (1, "rollout", "encode", "bulk")
    assert state.plan == RecordedPlan(EncoderSpec(**spec), 3, False, "")
    assert state.p0 == {0: "5-0", 1: "7-1"} and state.positions[0] == "6-0"
    assert state.replayed == {} and state.added0 == {}  # absent: counted from nothing
    assert state.cursor == ScanCursor(0, 17, 1, False) and (state.done, state.total) == (64, 0)
    assert (state.pid, state.beat, state.host) == (41, 1700000000.5, "pod-0")
    assert Registry(client).running() == state


def test_an_older_rollbacks_record_reads_as_a_replay(client: Any) -> None:
    client.hset(ROLLOUT_KEY, mapping={"target": "g1", "source": "g2", "kind": "rollback"})
    state = RolloutStore(client).load()
    assert state is not None
    assert (state.kind, state.mode, state.phase, state.plan) == (
        "rollback",
        "replay",
        "create",
        None,
    )
