"""What the gateway records for its SLIs (services/gateway/metrics.py), on a real
registry: the SLO it runs under comes from the table by its size, a request's stage
times count once, its queries one by one, and only a Search is held to a budget."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from services.common.slo import slo_for
from services.gateway.domain import SearchResult, Timings
from services.gateway.metrics import GatewayMetrics
from services.gateway.settings import GatewaySettings


def make(size: str = "xl") -> tuple[GatewayMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return GatewayMetrics.create(registry, "m", size, slo_for(size), rerank=False), registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    assert found is not None, (name, labels)
    return found


def result(partial: bool = False, total_ms: float = 120.0) -> SearchResult:
    return SearchResult(
        hits=[], model="m", partial=partial, timings=Timings(encode_ms=10, total_ms=total_ms)
    )


# The objectives written out, not read from SLOS: encode is the GTR paper's batch-1,
# 128-token latency per size (base 17 ms, large 34, xl 96, xxl 349), search and
# search_rerank the budgets of docs/deploy.md's size table.
EXPECTED = {
    "base": {"encode": 0.017, "search": 0.05, "search_rerank": 0.25},
    "large": {"encode": 0.034, "search": 0.075, "search_rerank": 0.3},
    "xl": {"encode": 0.096, "search": 0.15, "search_rerank": 0.4},
    "xxl": {"encode": 0.349, "search": 0.5, "search_rerank": 0.75},
}


@pytest.mark.parametrize("size", sorted(EXPECTED))
def test_the_slo_gauge_is_the_tables_row_of_the_size(size: str) -> None:
    """A gateway of ``size`` (slo_for, as the server picks it) exports that size's
    objectives, each under its own objective label."""
    _, registry = make(size)
    for objective, seconds in EXPECTED[size].items():
        got = value(registry, "gtr_slo_seconds", objective=objective, model="m", size=size)
        assert got == seconds, (size, objective)
    assert value(registry, "gateway_rerank_configured") == 0.0
    assert value(registry, "gateway_triton_configured") == 0.0


def test_series_exist_before_the_first_request() -> None:
    _, registry = make()
    assert value(registry, "gtr_encode_calls_total", model="m", size="xl") == 0
    for flag in ("true", "false"):
        assert value(registry, "gtr_search_seconds_count", model="m", size="xl", rerank=flag) == 0
        assert value(registry, "gateway_searches_total", reranked=flag) == 0
    assert value(registry, "gateway_partial_results_total") == 0


def test_a_batch_counts_its_stages_once_and_its_queries_one_by_one() -> None:
    metrics, registry = make()
    metrics.observe_encode(0.03, "m")  # the batch's one encoder call
    metrics.observe_request([result(partial=True), result(), result(partial=True)], None, "m")
    assert value(registry, "gtr_encode_calls_total", model="m", size="xl") == 1
    assert value(registry, "gtr_encode_seconds_count", model="m", size="xl") == 1
    total = value(registry, "gateway_stage_seconds_count", stage="total", model="m", size="xl")
    assert total == 1
    assert value(registry, "gateway_searches_total", reranked="false") == 3
    assert value(registry, "gateway_partial_results_total") == 2
    # a BatchSearch is held to no latency budget
    for flag in ("true", "false"):
        assert value(registry, "gtr_search_seconds_count", model="m", size="xl", rerank=flag) == 0


def test_a_search_is_held_to_the_budget_it_asked_for() -> None:
    metrics, registry = make("xl")  # 150 ms without rerank, 400 ms with
    metrics.observe_request([result(total_ms=300.0)], True, "m")
    metrics.observe_request([result(total_ms=300.0)], False, "m")
    with_rerank = {"model": "m", "size": "xl", "rerank": "true"}
    without = {"model": "m", "size": "xl", "rerank": "false"}
    assert value(registry, "gtr_search_seconds_bucket", le="0.4", **with_rerank) == 1
    assert value(registry, "gtr_search_seconds_bucket", le="0.15", **without) == 0
    assert value(registry, "gtr_search_seconds_bucket", le="0.4", **without) == 1


def test_a_failed_encode_is_a_valid_event_without_a_good_one() -> None:
    metrics, registry = make()
    metrics.observe_encode(None, "m")
    assert value(registry, "gtr_encode_calls_total", model="m", size="xl") == 1
    assert value(registry, "gtr_encode_seconds_count", model="m", size="xl") == 0


def test_an_unknown_encoder_size_is_refused_at_start() -> None:
    with pytest.raises(ValidationError, match="unknown encoder size 'huge'; known: base"):
        GatewaySettings(shards="127.0.0.1:1", encoder_size="huge")


def test_the_model_label_follows_the_encoder_that_answered() -> None:
    """After a switch to a generation with another encoder: its series start at 0 at the
    switch (prime), the requests it answers count under it, the objectives name it alone."""
    metrics, registry = make()
    metrics.prime("m2")
    assert value(registry, "gtr_encode_calls_total", model="m2", size="xl") == 0
    assert value(registry, "gtr_search_seconds_count", model="m2", size="xl", rerank="false") == 0
    assert (
        registry.get_sample_value(
            "gtr_slo_seconds", {"objective": "encode", "model": "m", "size": "xl"}
        )
        is None
    )
    assert value(registry, "gtr_slo_seconds", objective="encode", model="m2", size="xl") == 0.096
    metrics.observe_encode(0.03, "m2")
    metrics.observe_request([result()], False, "m2")
    assert value(registry, "gtr_encode_calls_total", model="m2", size="xl") == 1
    assert value(registry, "gtr_search_seconds_count", model="m2", size="xl", rerank="false") == 1
    assert value(registry, "gtr_search_seconds_count", model="m", size="xl", rerank="false") == 0
