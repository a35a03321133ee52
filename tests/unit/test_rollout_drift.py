"""Drift that acts (issue #24): the window of `index drift-watch`, and the watcher's
decisions on a real Redis registry (services/generations/drift.py, standby.py).

The window is checked against a model written out here from its definition (act when
every reading of the serving generation over the last `window` seconds was above the
threshold, with no gap longer than `stale_s`), on sequences hypothesis generates.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import FailedPrecondition
from services.generations.drift import (
    DRIFT_KEY,
    DriftPolicy,
    DriftWatcher,
    DriftWindow,
    Reading,
    WatchConfig,
)
from services.generations.registry import EncoderSpec, Registry
from services.generations.standby import await_generation
from tests.support.clock import Clock

POLICY = DriftPolicy(threshold=1.5, window_s=60.0, stale_s=25.0)


# --- the window --------------------------------------------------------------------------

# one poll: seconds since the previous one, the generation serving, the reading
polls = st.lists(
    st.tuples(
        st.sampled_from([1.0, 5.0, 10.0, 20.0, 30.0]),
        st.sampled_from(["g1", "g1", "g1", "g2"]),
        st.one_of(
            st.none(),
            st.just(math.nan),
            st.floats(min_value=0.5, max_value=3.0, allow_nan=False),
            st.just(1.5),
        ),
    ),
    max_size=40,
)


def model_fires(history: Sequence[tuple[float, str, float | None]], policy: DriftPolicy) -> bool:
    """The definition: the last reading is above, and going back from it every reading
    is above, of the same generation, with no gap over stale_s, back to one at least
    window_s old."""
    now, generation, ratio = history[-1]
    if ratio is None or math.isnan(ratio) or ratio <= policy.threshold:
        return False
    start = now
    later = now
    for t, gen, r in reversed(history[:-1]):
        if gen != generation or later - t > policy.stale_s:
            break
        if r is None:
            continue  # no replica answered: neither evidence nor counter-evidence
        if math.isnan(r) or r <= policy.threshold:
            break
        start = later = t
    return now - start >= policy.window_s


@settings(max_examples=300, deadline=None)
@given(polls)
def test_the_window_fires_exactly_when_the_ratio_stayed_above_for_the_whole_window(
    seq: list[tuple[float, str, float | None]],
) -> None:
    window = DriftWindow(POLICY)
    now = 0.0
    history: list[tuple[float, str, float | None]] = []
    for step, generation, ratio in seq:
        now += step
        history.append((now, generation, ratio))
        fired = window.observe(now, generation, ratio)
        assert fired == model_fires(history, POLICY), history


def test_a_steady_drift_fires_at_the_window_and_not_before() -> None:
    window = DriftWindow(DriftPolicy(threshold=1.5, window_s=3600, stale_s=100))
    fired = [window.observe(t, "g1", 3.13) for t in range(0, 3601, 30)]
    assert fired[-1] and not any(fired[:-1])


def test_one_reading_at_the_threshold_restarts_the_window() -> None:
    window = DriftWindow(DriftPolicy(threshold=1.5, window_s=60, stale_s=100))
    assert not window.observe(0, "g1", 2.0)
    assert not window.observe(50, "g1", 1.5)  # not above
    assert not window.observe(60, "g1", 2.0)
    assert not window.observe(100, "g1", 2.0)
    assert window.observe(120, "g1", 2.0)


def test_a_switch_restarts_the_window() -> None:
    window = DriftWindow(DriftPolicy(threshold=1.5, window_s=60, stale_s=100))
    window.observe(0, "g1", 2.0)
    assert not window.observe(70, "g2", 2.0)  # g2's streak starts here
    assert window.observe(130, "g2", 2.0)


def test_polls_that_reach_no_replica_neither_extend_nor_end_the_window() -> None:
    window = DriftWindow(DriftPolicy(threshold=1.5, window_s=60, stale_s=45))
    window.observe(0, "g1", 2.0)
    assert not window.observe(20, "g1", None)
    assert not window.observe(40, "g1", 2.0)  # 40 s after the last reading: kept
    assert window.observe(60, "g1", 2.0)
    window = DriftWindow(DriftPolicy(threshold=1.5, window_s=60, stale_s=25))
    window.observe(0, "g1", 2.0)
    window.observe(20, "g1", None)
    assert not window.observe(40, "g1", None)
    assert not window.observe(60, "g1", 2.0)  # 60 s without a reading: starts again
    assert window.above_for(60) == 0


@pytest.mark.parametrize(
    ("threshold", "window", "stale"), [(0, 60, 10), (math.inf, 60, 10), (1.5, -1, 10), (1.5, 1, 0)]
)
def test_a_policy_refuses_nonsense(threshold: float, window: float, stale: float) -> None:
    with pytest.raises(ValueError):
        DriftPolicy(threshold, window, stale)


def test_a_reading_takes_the_highest_finite_ratio() -> None:
    assert Reading([]).ratio is None
    assert Reading([[], []]).ratio is None
    nan = Reading([[math.nan], [math.nan, math.nan]]).ratio
    assert nan is not None and math.isnan(nan)
    assert Reading([[1.0, math.nan], [2.5]]).ratio == 2.5
    assert Reading([[1.0, 2.0], [2.5]]).answered == 3


# --- the watcher on a real Redis -----------------------------------------------------------


@pytest.fixture
def registry(redis_url: str) -> Iterator[Registry]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.hset("gtr:layout", mapping={"version": "2", "shards": "2"})
    reg = Registry(client)
    reg.ensure_first(2, EncoderSpec("embed", 1, 384), "/var/lib/gtr/data/index")
    yield reg
    client.flushdb()
    client.close()


def watcher(
    registry: Registry, readings: dict[str, Reading], runs: list[list[str]], status: int = 0
) -> tuple[DriftWatcher, Clock]:
    clock = Clock()

    def run(argv: Sequence[str]) -> int:
        runs.append(list(argv))
        return status

    config = WatchConfig(
        policy=DriftPolicy(1.5, 60, 40),
        interval_s=30,
        fallback_shards="g1-a:1;g1-b:1",
        rollout_argv=["gtr-retrieval", "index", "rollout", "--retrain", "--yes"],
    )
    return DriftWatcher(config, registry, readings.__getitem__, run, clock=clock), clock


def test_the_watcher_starts_one_retrain_after_the_window(registry: Registry) -> None:
    runs: list[list[str]] = []
    w, clock = watcher(registry, {"g1-a:1;g1-b:1": Reading([[3.13], [1.0]])}, runs)
    for t in (0, 30, 59):
        clock.now = t
        assert not w.poll()
    clock.now = 60
    assert w.poll()
    assert runs == [["gtr-retrieval", "index", "rollout", "--retrain", "--yes"]]
    record = {k.decode(): v.decode() for k, v in registry.redis.hgetall(DRIFT_KEY).items()}
    assert record["rollout"] == "done" and record["status"] == "0"
    # the window starts again: no second rollout at the next poll
    clock.now = 90
    assert not w.poll() and len(runs) == 1


def test_the_watcher_reads_the_serving_generations_addresses(registry: Registry) -> None:
    registry.set_addresses("g1", "dns:///g1-shards:1")
    runs: list[list[str]] = []
    w, clock = watcher(registry, {"dns:///g1-shards:1": Reading([[2.0]])}, runs)
    for t in (0, 30, 60):
        clock.now = t
        w.poll()
    assert len(runs) == 1


def test_a_running_rollout_holds_the_watcher(registry: Registry) -> None:
    runs: list[list[str]] = []
    w, clock = watcher(registry, {"g1-a:1;g1-b:1": Reading([[3.0], [3.0]])}, runs)
    clock.now = 0
    w.poll()
    registry.begin_rollout({"target": "g2", "phase": "bulk"})
    for t in (30, 60, 90):
        clock.now = t
        assert not w.poll()
    registry.end_rollout()
    clock.now = 120
    assert not w.poll()  # the window started again
    assert runs == []


def test_a_failed_rollout_is_recorded_and_not_retried_at_once(registry: Registry) -> None:
    runs: list[list[str]] = []
    w, clock = watcher(registry, {"g1-a:1;g1-b:1": Reading([[3.0], [3.0]])}, runs, status=3)
    for t in (0, 30, 60, 90):
        clock.now = t
        w.poll()
    assert len(runs) == 1
    assert registry.redis.hget(DRIFT_KEY, "rollout") == b"failed"
    assert registry.redis.hget(DRIFT_KEY, "status") == b"3"


def test_a_restarted_watcher_resumes_only_its_own_rollout(registry: Registry) -> None:
    runs: list[list[str]] = []
    w, _ = watcher(registry, {}, runs)
    registry.begin_rollout({"target": "g2", "phase": "bulk"})
    assert w.resume_if_ours() is None  # someone else's: left alone
    registry.redis.hset(DRIFT_KEY, "rollout", "running")
    assert w.resume_if_ours() == 0
    assert len(runs) == 1 and registry.redis.hget(DRIFT_KEY, "rollout") == b"done"


# --- standby shards: await-generation ----------------------------------------------------


def test_g1_records_its_addresses_at_once(registry: Registry) -> None:
    gen = await_generation(registry, "g1", "dns:///s0:1;dns:///s1:1")
    assert gen is not None and gen.name == "g1"
    assert registry.addresses("g1") == "dns:///s0:1;dns:///s1:1"


def test_a_target_is_waited_for_until_trained(registry: Registry) -> None:
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            registry.create(3, EncoderSpec("embed", 2, 384), "/gens/g2", {})
        if len(sleeps) == 4:
            g2 = registry.get("g2")
            registry.put(type(g2)(**{**g2.__dict__, "params": {"trained": True}}))

    gen = await_generation(registry, "g2", "dns:///g2-0:1", index_dir="/gens/g2/", sleep=sleep)
    assert gen is not None and gen.params["trained"] and len(sleeps) == 4
    assert registry.addresses("g2") == "dns:///g2-0:1"


def test_a_retired_generation_another_index_dir_or_shard_count_is_refused(
    registry: Registry,
) -> None:
    registry.create(2, EncoderSpec("embed", 2, 384), "/gens/g2", {"trained": True})
    with pytest.raises(FailedPrecondition, match="indexDir"):
        await_generation(registry, "g2", "x:1", index_dir="/elsewhere")
    with pytest.raises(FailedPrecondition, match=r"set its shards in index\.generations to 2"):
        await_generation(registry, "g2", "x:1;y:1;z:1", num_shards=3)
    registry.set_state("g2", "retired")
    with pytest.raises(FailedPrecondition, match="retired"):
        await_generation(registry, "g2", "x:1")
    assert registry.addresses("g2") is None


def test_waiting_gives_up_at_its_timeout(registry: Registry) -> None:
    clock = Clock()

    def sleep(seconds: float) -> None:
        clock.now += seconds

    with pytest.raises(TimeoutError):
        await_generation(registry, "g7", "x:1", timeout_s=10, clock=clock, sleep=sleep)


def test_await_generation_command_records_or_refuses(registry: Registry, redis_url: str) -> None:
    """The chart's init container, as the pod runs it: exit 0 once it may serve (its
    addresses recorded), exit 2 with the reason for a retired generation."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    registry.create(2, EncoderSpec("embed", 2, 384), "/gens/g2", {"trained": True})

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli.main",
                "index",
                "await-generation",
                *args,
                f"--redis-url={redis_url}",
            ],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    done = run("g2", "--addresses=dns:///g2-0:1;dns:///g2-1:1", "--index-dir=/gens/g2")
    assert done.returncode == 0, done.stderr
    assert registry.addresses("g2") == "dns:///g2-0:1;dns:///g2-1:1"
    registry.set_state("g2", "retired")
    refused = run("g2", "--addresses=x:1")
    assert refused.returncode == 2 and "g2 is retired" in refused.stderr
