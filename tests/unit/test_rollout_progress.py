"""The rollout's progress report (services/generations/progress.py): the Prometheus
metrics `index rollout --metrics-port` serves, scraped over HTTP as Prometheus does, and
the ETA from the rate of the last 10 s."""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from services.generations.progress import WARN_EVERY_S, ConsoleProgress, Progress
from tests.support.processes import free_port


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_metrics_port_serves_phase_documents_lag_and_eta() -> None:
    port = free_port()
    progress = ConsoleProgress(metrics_port=port, enabled=False)
    try:
        progress.phase("bulk")
        progress.total(1000, done=100)
        progress.advance(50)
        progress.advance(50)
        progress.lag(7)
        got = _scrape(port)
        assert got[("gtr_rollout_phase", (("phase", "bulk"),))] == 1
        assert got[("gtr_rollout_phase", (("phase", "train"),))] == 0
        assert got[("gtr_rollout_docs_reembedded_total", ())] == 100
        assert got[("gtr_rollout_docs", ())] == 1000
        assert got[("gtr_rollout_lag_entries", ())] == 7
        assert got[("gtr_rollout_docs_per_second", ())] > 0
        assert got[("gtr_rollout_eta_seconds", ())] > 0
        progress.phase("catch_up")
        assert _scrape(port)[("gtr_rollout_phase", (("phase", "bulk"),))] == 0
    finally:
        progress.close()


def test_the_eta_is_what_is_left_at_the_recent_rate() -> None:
    progress = Progress()
    progress.phase("bulk")
    progress.total(300, done=0)
    assert progress.eta_s is None  # no rate yet
    progress.advance(100)
    progress.advance(100)
    rate = progress.rate
    assert rate > 0 and progress.eta_s == (300 - 200) / rate
    progress.phase("catch_up")
    progress.lag(40)
    assert progress.eta_s == 40 / rate


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _catch_up(clock: _Clock, replayed_per_s: int, written_per_s: int, lag: int) -> Progress:
    """A catch-up seen for 5 s at these rates (one report a second)."""
    progress = Progress()
    progress.phase("catch_up")
    for second in range(6):
        clock.now = 1000.0 + second
        progress.advance(replayed_per_s if second else 0)
        progress.catch_up(lag, 10_000 + second * written_per_s)
    return progress


def test_a_catch_up_that_does_not_gain_on_the_writes_warns_with_no_eta(monkeypatch: Any) -> None:
    clock = _Clock()
    monkeypatch.setattr("services.generations.progress.time.monotonic", clock)
    progress = _catch_up(clock, replayed_per_s=9, written_per_s=20, lag=500)
    assert progress.rate == 9 and progress.write_rate == 20
    assert progress.eta_s is None and progress.losing
    warning = progress.behind()
    assert warning == (
        "catch-up is behind: lag 500 entries, replay 9.0/s vs writes 20.0/s, ETA never at this rate"
    )
    assert progress.behind() is None  # said once per WARN_EVERY_S
    clock.now += WARN_EVERY_S
    assert progress.behind() == warning


def test_a_catch_up_that_gains_has_the_eta_of_its_gain_and_no_warning(monkeypatch: Any) -> None:
    clock = _Clock()
    monkeypatch.setattr("services.generations.progress.time.monotonic", clock)
    progress = _catch_up(clock, replayed_per_s=80, written_per_s=20, lag=600)
    assert progress.eta_s == 600 / (80 - 20)
    assert progress.behind() is None and not progress.losing


def test_the_metrics_port_serves_the_catch_up_rates(monkeypatch: Any) -> None:
    port = free_port()
    progress = ConsoleProgress(metrics_port=port, enabled=False)
    try:
        clock = _Clock()
        monkeypatch.setattr("services.generations.progress.time.monotonic", clock)
        progress.phase("catch_up")
        for second in range(3):
            clock.now = 1000.0 + second
            progress.advance(5 if second else 0)
            progress.catch_up(40, 100 + 10 * second)
        got = _scrape(port)
        assert got[("gtr_rollout_lag_entries", ())] == 40
        assert got[("gtr_rollout_catch_up_entries_per_second", ())] == 5
        assert got[("gtr_rollout_source_writes_per_second", ())] == 10
        assert got[("gtr_rollout_catch_up_behind", ())] == 1
    finally:
        progress.close()
