"""The rollout's progress report (services/generations/progress.py): the Prometheus
metrics `index rollout --metrics-port` serves, scraped over HTTP as Prometheus does, and
the ETA from the rate of the last 10 s."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from services.generations.progress import ConsoleProgress, Progress
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
