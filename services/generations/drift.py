"""Drift that acts (issue #24): retrain when the quantizer stays out of fit for a window.

Every shard replica exports how well its trained IVF-PQ quantizer still fits what it
adds (``ShardStats.pq_error_ratio``, the gauge ``index_pq_error_ratio``: mean PQ
reconstruction error of recent adds over the error at training; NaN before its first
add). The alert ``GtrIndexQuantizerDrift`` says when it passes 1.5 for 30 minutes;
``gtr-retrieval index drift-watch`` acts on the same reading: it polls the **serving**
generation's replicas over the ``Stats`` RPC (the addresses the registry holds for it,
``{gtr}:addrs``; generation g1 falls back to ``--shards``) and, when the highest ratio of
any replica stays above ``threshold`` for the whole ``window`` (like a Prometheus rule's
``for:``), starts ``gtr-retrieval index rollout --retrain`` (docs/generations.md) as a
child process and waits for it.

The window (:class:`DriftWindow`) restarts when a reading is at or below the threshold or
NaN (no evidence of drift), when the serving generation changes (a switch: the new one's
quantizer was trained on the data of its time), while a rollout runs (whoever started it),
and after a gap of more than ``stale_s`` without a reading (a poll that reached no replica
neither extends nor ends the window, so one slow scrape does not throw away an hour of
evidence, but acting needs evidence over the window). One shard out of fit is enough: a
retrain replaces every shard's quantizer at once.

A rollout the watcher started is recorded in ``{gtr}:drift`` (``rollout`` = running |
done | failed, its start time and exit status): a watcher restarted while its rollout was
running (a rescheduled pod) runs ``index rollout --retrain`` again, which resumes the
recorded rollout from its saved phase; a rollout someone else runs is never touched.
"""

from __future__ import annotations

import asyncio
import logging
import math
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.index.client.addresses import parse_shard_addresses
from services.index.client.router import ShardRouter
from services.index.keys import FIRST_GENERATION, REGISTRY_TAG

log = logging.getLogger(__name__)

DRIFT_KEY = f"{REGISTRY_TAG}:drift"  # hash: what the drift watcher last started


@dataclass(frozen=True)
class DriftPolicy:
    """Act when the ratio stays above ``threshold`` for ``window_s`` seconds; a gap of
    more than ``stale_s`` without any reading restarts the window."""

    threshold: float
    window_s: float
    stale_s: float

    def __post_init__(self) -> None:
        if not (self.threshold > 0 and math.isfinite(self.threshold)):
            raise ValueError(f"threshold must be a positive number, not {self.threshold}")
        if not self.window_s >= 0:
            raise ValueError(f"window must be >= 0 seconds, not {self.window_s}")
        if not self.stale_s > 0:
            raise ValueError(f"stale_s must be > 0 seconds, not {self.stale_s}")


@dataclass
class DriftWindow:
    """The streak of readings above the threshold, of one serving generation."""

    policy: DriftPolicy
    generation: str | None = None
    since: float | None = None  # time of the first reading of the current streak
    last: float | None = None  # time of the last reading (any value)

    def reset(self) -> None:
        self.since = None

    def above_for(self, now: float) -> float:
        """Seconds the current streak has lasted (0 without one)."""
        return 0.0 if self.since is None else max(0.0, now - self.since)

    def observe(self, now: float, generation: str, ratio: float | None) -> bool:
        """Record one poll: ``ratio`` is the highest of the serving generation's replicas
        (NaN: they answered but have added nothing since they started; None: no replica
        answered). True when the ratio has stayed above the threshold for the window."""
        if generation != self.generation:
            self.generation, self.since, self.last = generation, None, None
        if self.last is not None and now - self.last > self.policy.stale_s:
            self.since = None  # too long without evidence: start again
        if ratio is None:
            return False
        self.last = now
        if math.isnan(ratio) or ratio <= self.policy.threshold:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= self.policy.window_s


@dataclass(frozen=True)
class Reading:
    """One poll of a generation's replicas: the ratio of each replica that answered, by
    shard (NaN: no add yet), and the highest finite one (None: no replica answered; NaN:
    none has a ratio yet)."""

    per_shard: list[list[float]] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return sum(len(s) for s in self.per_shard)

    @property
    def ratio(self) -> float | None:
        values = [r for shard in self.per_shard for r in shard]
        if not values:
            return None
        finite = [r for r in values if math.isfinite(r)]
        return max(finite) if finite else math.nan


async def read_ratios(spec: str, tls: Any = None) -> Reading:
    """Ask every replica of the generation at ``spec`` (the gateway's ``--shards`` syntax:
    ``;`` between shards, ``,`` between replicas, or one ``dns:///`` target per shard) for
    its Stats; replicas that do not answer within 5 s are left out."""

    router = ShardRouter(
        parse_shard_addresses(spec), coalesce=False, share_quantizer=False, tls=tls
    )
    try:
        stats = await router.stats()
    finally:
        await router.close()
    return Reading([[s.pq_error_ratio for s in shard if s is not None] for shard in stats])


@dataclass(frozen=True)
class WatchConfig:
    policy: DriftPolicy
    interval_s: float
    # g1's shard addresses when the registry holds none for it (the gateway's --shards)
    fallback_shards: str
    # argv of the rollout to start (``gtr-retrieval index rollout --retrain --yes ...``)
    rollout_argv: Sequence[str]

    @classmethod
    def of(
        cls,
        threshold: float,
        window_s: float,
        interval_s: float,
        fallback_shards: str,
        rollout_argv: Sequence[str],
    ) -> WatchConfig:
        """The watcher's config; a window goes stale after three polls without a
        reading. ValueError for a threshold or window the policy refuses."""
        policy = DriftPolicy(threshold, window_s, stale_s=3 * interval_s + 10)
        return cls(policy, interval_s, fallback_shards, rollout_argv)


class DriftMetrics:
    """``gtr_drift_*`` on the watcher's own registry."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        self.ratio = Gauge(
            "gtr_drift_pq_error_ratio",
            "Highest index_pq_error_ratio of the serving generation's replicas at the last "
            "poll (NaN: none has added anything yet or none answered).",
            registry=registry,
        )
        self.above = Gauge(
            "gtr_drift_above_threshold_seconds",
            "How long the ratio has stayed above the threshold (the rollout starts at the window).",
            registry=registry,
        )
        self.replicas = Gauge(
            "gtr_drift_replicas_answered",
            "Replicas that answered the last poll.",
            registry=registry,
        )
        self.rollouts = Counter(
            "gtr_drift_rollouts_total",
            "Rollouts (--retrain) the watcher started, by outcome (done, failed).",
            ["outcome"],
            registry=registry,
        )


class DriftWatcher:
    """The loop of ``index drift-watch``: poll, keep the window, start the rollout.

    ``registry`` is a :class:`~services.generations.registry.Registry`; ``read`` reads a
    generation's ratios from its address spec (:func:`read_ratios`); ``run`` runs the
    rollout's argv to its end and returns its exit status. All three are injected so that
    the loop runs against a real Redis and real shards in tests, and in the pod."""

    def __init__(
        self,
        config: WatchConfig,
        registry: Any,
        read: Callable[[str], Reading],
        run: Callable[[Sequence[str]], int] | None = None,
        metrics: DriftMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.registry = registry
        self.read = read
        self.run = run or ChildRunner()
        self.metrics = metrics
        self.clock = clock
        self.window = DriftWindow(config.policy)

    def spec_of(self, generation: str) -> str | None:
        spec = self.registry.addresses(generation)
        if spec:
            return str(spec)
        if generation == FIRST_GENERATION and self.config.fallback_shards:
            return self.config.fallback_shards
        return None

    def once(self) -> dict[str, Any]:
        """One reading of the serving generation, JSON-ready (``drift-watch --once``):
        its highest ratio (None: no replica answered or none has a ratio yet), whether
        that is above the threshold, and the ratios by shard."""
        serving = self.registry.alias().serving
        spec = self.spec_of(serving)
        reading = self.read(spec) if spec else None
        ratio = None if reading is None else reading.ratio
        threshold = self.config.policy.threshold
        return {
            "generation": serving,
            "ratio": None if ratio is None or math.isnan(ratio) else ratio,
            "threshold": threshold,
            "above": ratio is not None and ratio > threshold,
            "per_shard": []
            if reading is None
            else [[None if math.isnan(r) else r for r in s] for s in reading.per_shard],
        }

    def resume_if_ours(self) -> int | None:
        """At start: when the rollout the watcher started is still recorded as running
        and the registry still holds a rollout, run it again (it resumes); its status."""
        mine = _s(self.registry.redis.hget(DRIFT_KEY, "rollout"))
        if mine == "running" and self.registry.running() is not None:
            log.warning("the rollout this watcher started is unfinished: resuming it")
            return self._start_rollout(resume=True)
        return None

    def poll(self) -> bool:
        """One poll; True when it started (and finished) a rollout."""
        now = self.clock()
        if self.registry.running() is not None:
            # Someone's rollout runs: the serving generation is about to change.
            self.window.reset()
            self._show(None, now)
            return False
        serving = self.registry.alias().serving
        spec = self.spec_of(serving)
        if spec is None:
            log.warning("no shard addresses for the serving generation %s", serving)
            self.window.observe(now, serving, None)
            self._show(None, now)
            return False
        reading = self.read(spec)
        fire = self.window.observe(now, serving, reading.ratio)
        self._show(reading, now)
        if not fire:
            return False
        log.warning(
            "generation %s: PQ error ratio %.3f has stayed above %.3f for %.0f s: "
            "starting index rollout --retrain",
            serving,
            reading.ratio or math.nan,
            self.config.policy.threshold,
            self.window.above_for(now),
        )
        self._start_rollout(resume=False)
        self.window.reset()
        return True

    def _start_rollout(self, resume: bool) -> int:
        if not resume:
            self.registry.redis.hset(
                DRIFT_KEY,
                mapping={"rollout": "running", "started_at": str(time.time()), "status": ""},
            )
        status = self.run(list(self.config.rollout_argv))
        outcome = "done" if status == 0 else "failed"
        self.registry.redis.hset(
            DRIFT_KEY,
            mapping={"rollout": outcome, "status": str(status), "ended_at": str(time.time())},
        )
        if self.metrics is not None:
            self.metrics.rollouts.labels(outcome).inc()
        if status != 0:
            log.error(
                "index rollout --retrain exited %d: see its log; `gtr-retrieval index "
                "rollout` resumes it, `index rollout --abort` gives it up",
                status,
            )
        return status

    def _show(self, reading: Reading | None, now: float) -> None:
        if self.metrics is None:
            return
        ratio = reading.ratio if reading is not None else None
        self.metrics.ratio.set(math.nan if ratio is None else ratio)
        self.metrics.replicas.set(0 if reading is None else reading.answered)
        self.metrics.above.set(self.window.above_for(now))

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Poll every interval until ``stop`` is set (SIGTERM in the CLI)."""
        stop = stop or threading.Event()
        if not stop.is_set():
            self.resume_if_ours()
        while not stop.is_set():
            started = self.clock()
            try:
                self.poll()
            except Exception:  # a Redis hiccup must not end the watcher
                log.exception("drift poll failed")
            stop.wait(max(0.0, self.config.interval_s - (self.clock() - started)))


def watch_until_sigterm(watcher: DriftWatcher, runner: ChildRunner) -> None:
    """Run ``watcher`` until SIGTERM (the pod is stopping): the loop ends, and a rollout
    ``runner`` runs is stopped where it is (the next watcher resumes it)."""
    import signal

    stop = threading.Event()

    def on_sigterm(signum: int, frame: Any) -> None:
        stop.set()
        runner.terminate()

    signal.signal(signal.SIGTERM, on_sigterm)
    watcher.run_forever(stop)


def read_with_asyncio(tls: Any = None) -> Callable[[str], Reading]:
    """:func:`read_ratios` for the blocking loop."""

    def read(spec: str) -> Reading:
        return asyncio.run(read_ratios(spec, tls))

    return read


class ChildRunner:
    """Runs the rollout as a child process; :meth:`terminate` passes a SIGTERM on to it
    (the watcher is stopping: the rollout stops where it is and is resumed later)."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None

    def __call__(self, argv: Sequence[str]) -> int:
        log.info("running %s", " ".join(a for a in argv if "redis-url=" not in a))
        self.child = subprocess.Popen(list(argv))
        try:
            return self.child.wait()
        finally:
            self.child = None

    def terminate(self) -> None:
        child = self.child
        if child is not None and child.poll() is None:
            child.terminate()


def _s(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
