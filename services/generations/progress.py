"""What a rollout reports while it runs: a progress bar with its ETA on the terminal
(tqdm) and Prometheus metrics (``--metrics-port``), both fed by the builder through
:class:`Progress`.

=====================================  ==================================================
``gtr_rollout_phase{phase}``           1 for the running phase (train, bulk, catch_up,
                                       switch), else 0
``gtr_rollout_docs_reembedded_total``  documents encoded (``--retrain``: vectors reused)
                                       and appended, or source log entries replayed
``gtr_rollout_docs_per_second``        the rate of the last 10 s
``gtr_rollout_docs``                   documents the bulk pass expects (counted at start)
``gtr_rollout_lag_entries``            source log entries not yet replayed into the target
                                       (the entries the rollout holds)
``gtr_rollout_source_writes_per_second``  entries added to the source's logs, last 10 s
``gtr_rollout_catch_up_entries_per_second``  entries replayed in catch-up, last 10 s
``gtr_rollout_catch_up_behind``        1 while the replay is no faster than the writes
``gtr_rollout_eta_seconds``            what is left of the running phase at that rate (in
                                       catch-up: lag ÷ (replay rate − write rate); NaN
                                       when the replay does not gain on the writes)
=====================================  ==================================================

While the catch-up does not gain on the writes, :meth:`Progress.behind` gives a warning
(at most every ``WARN_EVERY_S``): "catch-up is behind: lag N entries, replay R/s vs
writes W/s, ETA never at this rate".
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

PHASES = ("train", "bulk", "catch_up", "switch")
WINDOW_S = 10.0  # the rates are those of the last WINDOW_S seconds
WARN_EVERY_S = 10.0  # a catch-up that is behind says so at most this often


class Progress:
    """The builder's reports; this base class keeps the figures and prints nothing."""

    def __init__(self) -> None:
        self.current = ""
        self.done = 0
        self.expected: int | None = None
        self.lag_entries: int | None = None
        self._window: deque[tuple[float, int]] = deque()
        self._added: deque[tuple[float, int]] = deque()  # (time, entries added to S's logs)
        self._warned = float("-inf")

    def phase(self, name: str) -> None:
        self.current = name

    def total(self, docs: int | None, done: int = 0) -> None:
        """The bulk pass expects ``docs`` documents, ``done`` of them already appended."""
        self.expected = docs
        self.done = done

    def advance(self, docs: int) -> None:
        self.done += docs
        _slide(self._window, self.done)

    def lag(self, entries: int) -> None:
        self.lag_entries = entries

    def catch_up(self, lag: int, added: int) -> None:
        """The catch-up's lag now, and the entries ever added to the source's logs (their
        rate is the write rate the replay must beat)."""
        _slide(self._added, added)
        self.lag(lag)

    @property
    def write_rate(self) -> float:
        """Entries added to the source's logs per second, last :data:`WINDOW_S` seconds."""
        return _rate(self._added)

    @property
    def losing(self) -> bool:
        """Whether the catch-up replays no faster than the source is written (False
        outside the catch-up, or before there are rates)."""
        if self.current != "catch_up" or len(self._window) < 2 or len(self._added) < 2:
            return False
        return self.rate <= self.write_rate

    def behind(self) -> str | None:
        """The warning of a catch-up that does not gain on the writes (None: it does, or
        it was said less than :data:`WARN_EVERY_S` ago, or there is no rate yet)."""
        if not self.losing:
            return None
        rate, writes = self.rate, self.write_rate
        now = time.monotonic()
        if now - self._warned < WARN_EVERY_S:
            return None
        self._warned = now
        return (
            f"catch-up is behind: lag {self.lag_entries} entries, replay {rate:.1f}/s vs "
            f"writes {writes:.1f}/s, ETA never at this rate"
        )

    def message(self, text: str) -> None:
        """A line for the operator (the CLI prints it)."""

    @property
    def rate(self) -> float:
        return _rate(self._window)

    @property
    def eta_s(self) -> float | None:
        """What is left of the running phase at the recent rate; in catch-up the lag over
        what the replay gains on the writes (None: it gains nothing)."""
        rate = self.rate
        if rate <= 0:
            return None
        if self.current == "bulk" and self.expected is not None:
            return max(0, self.expected - self.done) / rate
        if self.current == "catch_up" and self.lag_entries is not None:
            gain = rate - self.write_rate
            return self.lag_entries / gain if gain > 0 else None
        return None

    def close(self) -> None:
        """Release the bar and the metrics server."""


def _slide(window: deque[tuple[float, int]], count: int) -> None:
    now = time.monotonic()
    window.append((now, count))
    while len(window) > 2 and now - window[0][0] > WINDOW_S:
        window.popleft()


def _rate(window: deque[tuple[float, int]]) -> float:
    if len(window) < 2:
        return 0.0
    (t0, n0), (t1, n1) = window[0], window[-1]
    return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


class ConsoleProgress(Progress):
    """A tqdm bar on stderr per phase, and the metrics on ``metrics_port`` (None: none)."""

    def __init__(self, metrics_port: int | None = None, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled
        self._bar: Any = None
        self._server: Any = None
        self._metrics: dict[str, Any] = {}
        if metrics_port is not None:
            self._serve_metrics(metrics_port)

    def _serve_metrics(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        registry = CollectorRegistry()
        self._metrics = {
            "phase": Gauge(
                "gtr_rollout_phase", "1 for the running phase", ["phase"], registry=registry
            ),
            "docs": Counter(
                "gtr_rollout_docs_reembedded",
                "Documents re-embedded (or vectors reused) and appended",
                registry=registry,
            ),
            "rate": Gauge(
                "gtr_rollout_docs_per_second", "Rate of the last 10 s", registry=registry
            ),
            "expected": Gauge(
                "gtr_rollout_docs", "Documents the bulk pass expects", registry=registry
            ),
            "lag": Gauge(
                "gtr_rollout_lag_entries", "Source log entries not yet replayed", registry=registry
            ),
            "eta": Gauge(
                "gtr_rollout_eta_seconds", "Time left in the running phase", registry=registry
            ),
            "writes": Gauge(
                "gtr_rollout_source_writes_per_second",
                "Entries added to the source's logs per second (last 10 s)",
                registry=registry,
            ),
            "replay": Gauge(
                "gtr_rollout_catch_up_entries_per_second",
                "Source log entries replayed per second in catch-up (last 10 s)",
                registry=registry,
            ),
            "behind": Gauge(
                "gtr_rollout_catch_up_behind",
                "1 while the catch-up replays no faster than the source is written",
                registry=registry,
            ),
        }
        for name in PHASES:
            self._metrics["phase"].labels(name).set(0)
        self._server, _ = start_http_server(port, registry=registry)

    def phase(self, name: str) -> None:
        super().phase(name)
        if self._metrics:
            for p in PHASES:
                self._metrics["phase"].labels(p).set(1 if p == name else 0)
        self._close_bar()
        if self.enabled and name in PHASES and name != "switch":
            self._open_bar(name, None, 0)

    def _open_bar(self, name: str, total: int | None, initial: int) -> None:
        from tqdm import tqdm

        unit = "entries" if name == "catch_up" else "docs"
        self._bar = tqdm(
            desc=name, unit=unit, total=total, initial=initial, dynamic_ncols=True, smoothing=0.1
        )

    def total(self, docs: int | None, done: int = 0) -> None:
        super().total(docs, done)
        if self._metrics and docs is not None:
            self._metrics["expected"].set(docs)
        if self._bar is not None:  # a new bar starting at `done` (not counted in its rate)
            self._close_bar()
            self._open_bar(self.current, docs, done)

    def advance(self, docs: int) -> None:
        super().advance(docs)
        if self._metrics:
            self._metrics["docs"].inc(docs)
            self._metrics["rate"].set(self.rate)
            eta = self.eta_s
            self._metrics["eta"].set(float("nan") if eta is None else eta)
        if self._bar is not None:
            self._bar.update(docs)

    def lag(self, entries: int) -> None:
        super().lag(entries)
        if self._metrics:
            self._metrics["lag"].set(entries)
            if self.current == "catch_up":
                self._metrics["writes"].set(self.write_rate)
                self._metrics["replay"].set(self.rate)
                self._metrics["behind"].set(1 if self.rate <= self.write_rate else 0)
                eta = self.eta_s
                self._metrics["eta"].set(float("nan") if eta is None else eta)
        if self._bar is not None:
            self._bar.set_postfix(lag=entries, refresh=False)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            import sys

            print(text, file=sys.stderr)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self._close_bar()
        if self._server is not None:
            self._server.shutdown()
            self._server = None
