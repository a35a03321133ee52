"""Gateway metrics, on a registry injected by the server."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.slo import SizeSlo
from services.gateway.domain import SearchResult
from services.rpc.metrics import latency_histogram
from services.telemetry import tracing


@dataclass
class GatewayMetrics:
    """What the gateway records per request; the SLIs of services/common/slo.py.

    The ``model`` label is the encoder of the index generation that answered (each
    observation names it), not the one the gateway started with: after a switch to a
    generation with another encoder its series are new ones, created at 0 as soon as the
    gateway learns of the switch (:meth:`prime`). ``size`` (--encoder-size, the SLO's
    row) stays the configured one."""

    stage_seconds: Histogram
    encode_seconds: Histogram
    encode_calls: Counter
    search_seconds: Histogram
    partial_results: Counter
    searches: Counter
    model: str  # the model the gateway started with (the first generation it served)
    size: str
    slo_seconds: Gauge | None = None
    slo: SizeSlo | None = None
    _primed: set[str] = field(default_factory=set)

    @classmethod
    def create(
        cls,
        registry: CollectorRegistry,
        model: str,
        size: str,
        slo: SizeSlo,
        rerank: bool = False,
        triton: bool = False,
    ) -> GatewayMetrics:
        """``slo``: the objectives this gateway runs under, exported as
        ``gtr_slo_seconds{objective}`` (encode, search, search_rerank): the numbers the
        rules were generated from (services/common/slo.py). ``rerank`` / ``triton``:
        whether a reranker is configured and whether the encoder is Triton
        (``gateway_rerank_configured``, ``gateway_triton_configured``: the rerank and
        triton jobs are only expected to be scraped where a gateway uses them)."""
        gauge = Gauge(
            "gtr_slo_seconds",
            "Latency objective this gateway runs under (services/common/slo.py).",
            ["objective", "model", "size"],
            registry=registry,
        )
        Gauge(
            "gateway_rerank_configured",
            "1 when this gateway has a rerank service configured, else 0.",
            registry=registry,
        ).set(1.0 if rerank else 0.0)
        Gauge(
            "gateway_triton_configured",
            "1 when this gateway encodes on Triton, 0 with the in-process encoder.",
            registry=registry,
        ).set(1.0 if triton else 0.0)
        metrics = cls(
            stage_seconds=latency_histogram(
                "gateway_stage_seconds",
                "Wall time per stage of a search request (encode, search, fetch, total: "
                "once per request; rerank: once per reranked query).",
                ["stage", "model", "size"],
                registry=registry,
            ),
            encode_seconds=latency_histogram(
                "gtr_encode_seconds",
                "Time of a successful query encoder call, one per Search or BatchSearch "
                "request that is not answered from the query cache (the encode SLI's good "
                "events).",
                ["model", "size"],
                registry=registry,
            ),
            encode_calls=Counter(
                "gtr_encode_calls_total",
                "Query encoder calls, failed and timed-out ones included (the encode SLI's "
                "valid events).",
                ["model", "size"],
                registry=registry,
            ),
            search_seconds=latency_histogram(
                "gtr_search_seconds",
                "End-to-end time of a Search request answered OK, by whether it asked for "
                "a rerank (the search SLI's good events; its valid events are "
                'grpc_server_handled_total{service="gateway", method="Search"}).',
                ["model", "size", "rerank"],
                registry=registry,
            ),
            partial_results=Counter(
                "gateway_partial_results_total",
                "Queries answered with some shards missing (each query of a BatchSearch).",
                registry=registry,
            ),
            searches=Counter(
                "gateway_searches_total",
                "Queries answered (each query of a BatchSearch), by whether they were reranked.",
                ["reranked"],
                registry=registry,
            ),
            model=model,
            size=size,
            slo_seconds=gauge,
            slo=slo,
        )
        for flag in ("true", "false"):
            metrics.searches.labels(flag)
        metrics.prime(model)
        return metrics

    def prime(self, model: str) -> None:
        """Create ``model``'s series at 0 (once), so that rate() sees its first request and
        an SLI has its good events at 0 (not absent) while every request fails; the
        objectives' gauge names ``model`` alone from now on (the serving encoder)."""
        if model in self._primed:
            return
        self._primed.add(model)
        self.encode_calls.labels(model, self.size)
        self.encode_seconds.labels(model, self.size)
        for flag in ("true", "false"):
            self.search_seconds.labels(model, self.size, flag)
        if self.slo_seconds is not None and self.slo is not None:
            self.slo_seconds.clear()
            for objective, seconds in (
                ("encode", self.slo.encode_s),
                ("search", self.slo.search_s),
                ("search_rerank", self.slo.search_rerank_s),
            ):
                self.slo_seconds.labels(objective, model, self.size).set(seconds)

    def observe_encode(self, seconds: float | None, model: str) -> None:
        """One encoder call (a BatchSearch's whole batch is one) of ``model`` (the
        answering generation's encoder). ``None``: it failed or timed out, a miss of the
        encode SLI."""
        self.prime(model)
        self.encode_calls.labels(model, self.size).inc()
        if seconds is not None:
            self.encode_seconds.labels(model, self.size).observe(seconds, tracing.exemplar())

    def observe_request(
        self, results: Sequence[SearchResult], slo_rerank: bool | None, model: str
    ) -> None:
        """One answered search request: its stage times once (the rerank once per
        reranked query, each a call of its own), its queries one by one. ``slo_rerank``:
        for a Search, whether it asked for a rerank (which budget it is held to); None
        for a BatchSearch, which no latency SLO covers (its time grows with the batch).
        ``model``: the encoder of the generation that answered (also for a sparse search,
        whose query it did not encode: the series are the generation's)."""
        if not results:
            return
        self.prime(model)
        exemplar = tracing.exemplar()  # the request's trace id, when it is traced
        t = results[0].timings
        # the batch's one encode (0 for a sparse query: read it off a query that was encoded)
        encode_ms = max(r.timings.encode_ms for r in results)
        for stage, ms in (
            ("encode", encode_ms),
            ("search", t.search_ms),
            ("fetch", t.fetch_ms),
            ("total", t.total_ms),
        ):
            if ms or stage == "total":
                self.stage_seconds.labels(stage, model, self.size).observe(ms / 1000.0, exemplar)
        for result in results:
            if result.timings.rerank_ms:
                self.stage_seconds.labels("rerank", model, self.size).observe(
                    result.timings.rerank_ms / 1000.0, exemplar
                )
            if result.partial:
                self.partial_results.inc()
            self.searches.labels(str(result.reranked).lower()).inc()
        if slo_rerank is not None:
            self.search_seconds.labels(model, self.size, str(slo_rerank).lower()).observe(
                t.total_ms / 1000.0, exemplar
            )


@dataclass
class QueryCacheMetrics:
    """The query-embedding cache (services/gateway/query_cache.py)."""

    lookups: Counter
    errors: Counter
    stores: Counter
    evictions: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> QueryCacheMetrics:
        return cls(
            lookups=Counter(
                "gateway_query_cache_lookups_total",
                "Query embeddings looked up in the cache, by result: hit, miss, error (the "
                "lookup failed or was too slow; encoded instead), bypassed (skipped while "
                "the cache's Redis recently failed).",
                ["result"],
                registry=registry,
            ),
            errors=Counter(
                "gateway_query_cache_errors_total",
                "Failed cache operations (lookup, store); a search never fails by one.",
                ["op"],
                registry=registry,
            ),
            stores=Counter(
                "gateway_query_cache_stores_total",
                "Embeddings written to the cache (stored), or not (dropped: too many "
                "writes pending or the cache bypassed).",
                ["result"],
                registry=registry,
            ),
            evictions=Counter(
                "gateway_query_cache_evictions_total",
                "Entries evicted (least recently used) to keep the cache's size bound.",
                registry=registry,
            ),
        )


@dataclass
class GenerationMetrics:
    """Which index generation this gateway serves, and the writes a switch moved
    (services/gateway/generations.py; docs/generations.md)."""

    epoch: Gauge
    serving_generation: Gauge
    moved_writes: Counter
    refresh_errors: Counter
    dual_encodes: Counter
    rollout_holds: Counter
    rollout_held: Counter
    _named: str = ""

    @classmethod
    def create(cls, registry: CollectorRegistry) -> GenerationMetrics:
        return cls(
            epoch=Gauge(
                "gateway_generation_alias_epoch",
                "Epoch of the generations alias as this gateway last read it (one more per "
                "switch of the serving generation).",
                registry=registry,
            ),
            serving_generation=Gauge(
                "gateway_serving_generation",
                "1 for the index generation this gateway answers with (the alias's "
                "serving one as it last read it).",
                ["generation"],
                registry=registry,
            ),
            moved_writes=Counter(
                "gateway_generation_moved_writes_total",
                "Writes refused by a moved writer gate (a switch of the serving generation) "
                "and written again to the new one; a write that runs out of deadline meanwhile "
                "is answered UNAVAILABLE.",
                registry=registry,
            ),
            refresh_errors=Counter(
                "gateway_generation_alias_refresh_errors_total",
                "Background reads of the generations alias that failed (the gateway serves on "
                "with the generation it knows).",
                registry=registry,
            ),
            dual_encodes=Counter(
                "gateway_generation_dual_encodes_total",
                "Upserts encoded with a rollout target's encoder too (the dual write): "
                "outcome encoded (logged with the write), late (ended after the write, kept "
                "beside its log entry), or failed (the rollout re-embeds it).",
                ["outcome"],
                registry=registry,
            ),
            rollout_holds=Counter(
                "gateway_rollout_holds_total",
                "Pauses of a rollout's processes while this gateway had searches in flight "
                "(--hold-file: the local stack's; services/process/hold.py).",
                registry=registry,
            ),
            rollout_held=Counter(
                "gateway_rollout_held_seconds_total",
                "Seconds a rollout's processes were paused by this gateway's searches.",
                registry=registry,
            ),
        )

    def rollout_held_for(self, seconds: float) -> None:
        self.rollout_holds.inc()
        self.rollout_held.inc(seconds)

    def serving(self, generation: str, epoch: int, model: str = "") -> None:
        self.epoch.set(epoch)
        if generation != self._named:
            if self._named:
                self.serving_generation.labels(self._named).set(0)
            self.serving_generation.labels(generation).set(1)
            self._named = generation

    def refresh_failed(self) -> None:
        self.refresh_errors.inc()


@dataclass
class ServingEvents:
    """The generation source's events for the gateway's metrics: which generation serves
    (:class:`GenerationMetrics`) and its encoder's series, created at the switch
    (:meth:`GatewayMetrics.prime`)."""

    generations: GenerationMetrics
    requests: GatewayMetrics

    def serving(self, generation: str, epoch: int, model: str) -> None:
        self.generations.serving(generation, epoch, model)
        self.requests.prime(model)

    def refresh_failed(self) -> None:
        self.generations.refresh_failed()
