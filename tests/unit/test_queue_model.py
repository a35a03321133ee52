"""bench.queue_model: the M/G/c queue that says what queueing alone allows (issue #34)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench import queue_model


def test_requests_wait_for_the_first_free_server_in_arrival_order() -> None:
    # arrivals at 1, 2, 3 s; 2.5 s of service each; two servers: the third waits 0.5 s
    out = queue_model.response_times(1.0, 2, np.array([2.5, 2.5, 2.5]), np.array([1.0, 1, 1]))
    assert out.tolist() == [2.5, 2.5, 3.0]
    # one server: each waits for the one before
    out = queue_model.response_times(1.0, 1, np.array([2.5, 2.5, 2.5]), np.array([1.0, 1, 1]))
    assert out.tolist() == [2.5, 4.0, 5.5]


def test_an_mm1_queue_holds_the_rate_its_closed_form_gives() -> None:
    """M/M/1: the response time is exponential with rate mu - lambda, so its p99 is
    ln(100) / (mu - lambda), and the highest rate within an SLO is mu - ln(100) / SLO."""
    mean_ms, slo_ms = 10.0, 100.0
    service = np.random.default_rng(7).exponential(mean_ms, size=50_000)
    mu = 1e3 / float(service.mean())
    exact = mu - math.log(100) / (slo_ms / 1e3)
    model = queue_model.best_rate(service.tolist(), 1, slo_ms, requests=200_000)
    assert model.best_rate == pytest.approx(exact, rel=0.08)
    assert model.p99_ms <= slo_ms
    assert model.ceiling == pytest.approx(mu)


def test_more_servers_hold_more_and_a_service_longer_than_the_slo_holds_nothing() -> None:
    service = [8.0, 9.0, 10.0, 14.0]
    one, two = (queue_model.best_rate(service, c, 50.0) for c in (1, 2))
    assert two.best_rate > 1.5 * one.best_rate
    assert 0 < two.over_ceiling < 1
    assert queue_model.best_rate([60.0], 2, 50.0).best_rate == 0.0
    with pytest.raises(ValueError):
        queue_model.best_rate([], 2, 50.0)
