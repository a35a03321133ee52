"""The query-embedding cache against real Redis servers and the real MiniLM encoder.

Through the gateway over gRPC (one stack for the module, its cache in a Redis of its own
that a test kills): a hit after a miss and the response saying so, a batch that looks
up all its queries at once and encodes only its misses, a cache that is down or hung
costing no search. On the cache itself: the TTL, the size bound under concurrent
inserts from several clients, entries of different models and sizes kept apart.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis

from retrieval.v1 import (
    common_pb2,
    documents_pb2,
    documents_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)
from services.common.deadline import Deadline
from services.encoder.base import Embeddings, Encoder
from services.encoder.profiles import Kind
from services.gateway.query_cache import KEY_PREFIX, LRU_KEY, QueryEmbeddingCache, normalise
from services.process.redis_client import sync_client
from tests.support.background import BackgroundStack, stack_in_background
from tests.support.processes import (
    RestartableRedis,
    await_until,
    free_port,
    run_redis,
    start_redis,
    stop_process,
    wait_until,
)
from tests.support.sample_docs import STDLIB_DOCS
from tests.support.shards import scifact_vectors, shared_test_index

DOCS = STDLIB_DOCS


def entries(client: redis.Redis) -> set[bytes]:
    return {k for k in client.scan_iter(match=KEY_PREFIX + "*") if k != LRU_KEY.encode()}


# --- through the gateway --------------------------------------------------------------


class Front:
    def __init__(self, bg: BackgroundStack, cache_redis: RestartableRedis) -> None:
        self.bg = bg
        self.cache_redis = cache_redis
        self.channel = grpc.insecure_channel(bg.address)
        self.search = search_pb2_grpc.SearchServiceStub(self.channel)
        self.docs = documents_pb2_grpc.DocumentServiceStub(self.channel)
        self.token = common_pb2.WriteToken()

    def cache_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.cache_redis.url)

    def metric(self, name: str, **labels: str) -> float:
        value = self.bg.stack.gateway.registry.get_sample_value(name, labels)
        return float(value or 0.0)

    def request(self, query: str, k: int = 2) -> search_pb2.SearchRequest:
        return search_pb2.SearchRequest(
            query=query, k=k, consistency=common_pb2.CONSISTENCY_SESSION, write_token=self.token
        )


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Iterator[Front]:
    base = tmp_path_factory.getbasetemp()
    index_dir = shared_test_index(base, scifact_vectors(scifact_dir))
    tmp = tmp_path_factory.mktemp("query-cache")
    port = free_port()
    cache_redis = RestartableRedis(port, tmp / "cache", start_redis(tmp / "cache", port))
    try:
        with (
            run_redis(tmp / "store") as store,
            stack_in_background(
                store.url,
                index_dir,
                tmp,
                gateway_settings={
                    "query_cache": True,
                    "query_cache_redis_url": cache_redis.url,
                    "query_cache_lowercase": True,  # all-MiniLM-L6-v2 is uncased
                    # a lookup that must hit has room on a slow machine (the default,
                    # 50 ms, counts a late answer as an error and bypasses the cache);
                    # a SIGSTOPped Redis still outlasts it
                    "query_cache_timeout_ms": 500,
                },
            ) as bg,
        ):
            f = Front(bg, cache_redis)
            up = f.docs.Upsert(
                documents_pb2.UpsertRequest(
                    documents=[documents_pb2.Document(id=i, title=t, text=x) for i, t, x in DOCS]
                ),
                timeout=60,
            )
            f.token.CopyFrom(up.write_token)
            yield f
            f.channel.close()
    finally:
        stop_process(cache_redis.process)


def test_a_repeated_query_is_answered_from_the_cache_and_says_so(front: Front) -> None:
    client = front.cache_client()
    client.flushdb()
    hits_before = front.metric("gateway_query_cache_lookups_total", result="hit")
    misses_before = front.metric("gateway_query_cache_lookups_total", result="miss")

    first = front.search.Search(front.request("How do I read a CSV file"), timeout=30)
    assert not first.embedding_cached and first.hits[0].id == "py-csv"
    wait_until(lambda: len(entries(client)) == 1, what="the embedding is stored")

    # the same query as the encoder reads it: other spacing, case and Unicode form
    again = front.search.Search(front.request("  how do i\tread a\u00a0csv  FILE "), timeout=30)
    assert again.embedding_cached
    assert [(h.id, h.first_stage_score) for h in again.hits] == [
        (h.id, h.first_stage_score) for h in first.hits
    ], "the cached embedding is the encoder's"
    assert front.metric("gateway_query_cache_lookups_total", result="hit") == hits_before + 1
    assert front.metric("gateway_query_cache_lookups_total", result="miss") == misses_before + 1

    other = front.search.Search(front.request("How do I read a JSON file"), timeout=30)
    assert not other.embedding_cached, "another text is another entry"


def test_a_batch_looks_up_every_query_and_encodes_only_its_distinct_misses(
    front: Front,
) -> None:
    client = front.cache_client()
    client.flushdb()
    front.search.Search(front.request("sha256 digest of some bytes"), timeout=30)
    wait_until(lambda: len(entries(client)) == 1, what="the first embedding is stored")
    before = front.metric("gateway_query_cache_lookups_total", result="miss")

    batch = search_pb2.BatchSearchRequest(
        requests=[
            front.request("sha256 digest of some bytes"),
            front.request("run functions in a thread pool"),
            front.request("run  functions in a thread pool", k=1),
            front.request("parse json text"),
        ]
    )
    replies = front.search.BatchSearch(batch, timeout=30).responses
    assert [r.embedding_cached for r in replies] == [True, False, False, False]
    assert replies[0].hits[0].id == "py-hash"
    assert replies[1].hits[0].id == replies[2].hits[0].id == "py-thread"
    assert len(replies[2].hits) == 1
    assert front.metric("gateway_query_cache_lookups_total", result="miss") == before + 3
    # two distinct misses: two entries stored, the duplicate text once
    wait_until(lambda: len(entries(client)) == 3, what="the misses are stored")
    assert len(entries(client)) == 3


def test_a_cache_that_is_down_or_hung_costs_no_search(front: Front) -> None:
    errors = front.metric("gateway_query_cache_errors_total", op="lookup")
    front.cache_redis.kill()
    try:
        reply = front.search.Search(front.request("comma separated values"), timeout=30)
        assert reply.hits[0].id == "py-csv" and not reply.embedding_cached
        assert front.metric("gateway_query_cache_errors_total", op="lookup") == errors + 1
        # bypassed for a while after the error: no connection attempt per search
        reply = front.search.Search(front.request("comma separated values"), timeout=30)
        assert reply.hits and not reply.embedding_cached
    finally:
        front.cache_redis.start()

    # a hung cache (SIGSTOP): the lookup is given up after its timeout, the search answers
    wait_until(
        lambda: front.search.Search(front.request("a json document"), timeout=30).embedding_cached,
        timeout=15,
        what="the cache is used again once its Redis is back",
    )
    errors = front.metric("gateway_query_cache_errors_total", op="lookup")
    os.kill(front.cache_redis.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        reply = front.search.Search(front.request("a json document"), timeout=30)
        took = time.monotonic() - started
        assert reply.hits[0].id == "py-json" and not reply.embedding_cached
        assert front.metric("gateway_query_cache_errors_total", op="lookup") == errors + 1
        assert took < 10, f"a hung cache held the search {took:.1f} s"
    finally:
        os.kill(front.cache_redis.process.pid, signal.SIGCONT)


# --- the cache on its own ---------------------------------------------------------------


def _vectors(n: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _cache(url: str, **overrides: object) -> QueryEmbeddingCache:
    options: dict[str, object] = {
        "model": "all-MiniLM-L6-v2",
        "size": "minilm",
        "dim": 8,
        "ttl_s": 60.0,
        "max_entries": 1000,
        "timeout_s": 2.0,
    }
    options.update(overrides)
    return QueryEmbeddingCache(url, **options)  # type: ignore[arg-type]


def test_an_entry_expires_after_its_ttl_and_a_hit_does_not_extend_it(any_redis_url: str) -> None:
    redis_url = any_redis_url
    client = sync_client(redis_url)

    async def scenario() -> None:
        cache = _cache(redis_url, ttl_s=3.0, touch_s=10.0)  # 3 s: room for a stall
        try:
            cache.store(cache.keys(["q"], "query"), _vectors(1, 8, 0), [True])
            await cache.drain()
            (key,) = entries(client)
            assert 0 < client.pttl(key) <= 3000
            inserted = client.zscore(LRU_KEY, key)
            (hit,) = await cache.lookup(cache.keys(["q"], "query"))
            assert hit is not None and hit.truncated
            assert client.zscore(LRU_KEY, key) == inserted, (
                "a hit within the touch interval writes nothing"
            )
            np.testing.assert_array_equal(hit.vector, _vectors(1, 8, 0)[0])
            await asyncio.sleep(0.5)  # the TTL runs on meanwhile
            await cache.lookup(cache.keys(["q"], "query"))
            assert client.pttl(key) <= 2500, "a hit does not extend the TTL"
            await await_until(lambda: not client.exists(key), "Redis expired the entry", 10, 0.02)
            assert await cache.lookup(cache.keys(["q"], "query")) == [None]
            assert client.zcard(LRU_KEY) == 0, "the expired entry left the LRU set"
        finally:
            await cache.close()

    asyncio.run(scenario())


def test_the_size_bound_holds_under_concurrent_inserts_from_several_gateways(
    any_redis_url: str,
) -> None:
    redis_url = any_redis_url
    client = sync_client(redis_url)
    bound = 40

    async def scenario() -> None:
        # touch_s=0: every hit is a use (exact LRU order, which the test checks)
        caches = [_cache(redis_url, max_entries=bound, touch_s=0.0) for _ in range(4)]
        try:

            async def insert(c: int, wave: int) -> None:
                texts = [f"gateway {c} wave {wave} text {j}" for j in range(7)]
                caches[c].store(
                    caches[c].keys(texts, "query"), _vectors(7, 8, c * 100 + wave), [False] * 7
                )
                await caches[c].drain()

            await asyncio.gather(*[insert(c, w) for c in range(4) for w in range(12)])
            live = entries(client)
            members = set(client.zrange(LRU_KEY, 0, -1))
            assert len(live) == bound, f"{len(live)} entries for a bound of {bound}"
            assert live == members, "every live entry is in the LRU set and no other"
            # the least recently used go first: an entry looked up before each wave
            # outlives twice the bound of newer inserts; the one not touched does not
            caches[0].store(
                caches[0].keys(["survivor", "forgotten"], "query"), _vectors(2, 8, 9), [False] * 2
            )
            await caches[0].drain()
            for wave in range(2 * bound // 7 + 1):
                assert (await caches[2].lookup(caches[2].keys(["survivor"], "query")))[
                    0
                ] is not None, wave
                await insert(1, 100 + wave)
            assert (await caches[3].lookup(caches[3].keys(["forgotten"], "query"))) == [None]
            assert len(entries(client)) == bound
        finally:
            for cache in caches:
                await cache.close()

    asyncio.run(scenario())


def test_models_sizes_and_kinds_never_share_an_entry(any_redis_url: str) -> None:
    redis_url = any_redis_url

    async def scenario() -> None:
        variants = [
            _cache(redis_url),
            _cache(redis_url, size="base"),
            _cache(redis_url, model="gtr-t5-base"),
            _cache(redis_url, dim=16),
        ]
        try:
            for n, cache in enumerate(variants):
                assert await cache.lookup(cache.keys(["shared text"], "query")) == [None], n
                cache.store(
                    cache.keys(["shared text"], "query"), _vectors(1, cache.dim, n), [False]
                )
                await cache.drain()
            for n, cache in enumerate(variants):
                (hit,) = await cache.lookup(cache.keys(["shared text"], "query"))
                assert hit is not None
                np.testing.assert_array_equal(hit.vector, _vectors(1, cache.dim, n)[0])
            assert await variants[0].lookup(variants[0].keys(["shared text"], "document")) == [None]
        finally:
            for cache in variants:
                await cache.close()

    asyncio.run(scenario())


# --- the key's normal form is the tokenizer's ---------------------------------------------


class _Counting(Encoder):
    """The real encoder, counting the texts it is asked to embed."""

    def __init__(self, inner: Encoder) -> None:
        self.inner = inner
        self.model_name, self.dim, self.max_batch = inner.model_name, inner.dim, inner.max_batch
        self.calls: list[list[str]] = []

    async def encode(
        self, texts: Sequence[str], kind: Kind, timeout: float | None = None
    ) -> Embeddings:
        self.calls.append(list(texts))
        return await self.inner.encode(texts, kind, timeout)

    async def close(self) -> None:
        await self.inner.close()


def test_texts_with_one_normal_form_embed_alike_with_the_real_tokenizer() -> None:
    """What the key folds together, MiniLM's tokenizer reads alike (the embeddings are
    equal), and texts it reads differently get different keys."""
    from services.encoder.runtime.inprocess import InProcessEncoder

    same = [
        ("Read a CSV file", "  read a\tcsv\n file "),
        ("Caf\u00e9 cr\u00e8me", "cafe\u0301 cre\u0300me"),  # NFC vs NFD
        ("tab\tand\u3000ideographic space", "tab and ideographic space"),
    ]

    async def scenario() -> None:
        encoder = InProcessEncoder.torch()
        try:
            for a, b in same:
                assert normalise(a, lowercase=True) == normalise(b, lowercase=True), (a, b)
                got = await encoder.encode([a, b], "query")
                np.testing.assert_allclose(got.vectors[0], got.vectors[1], atol=1e-5)
            assert normalise("a\fb") != normalise("a b"), "BERT deletes \\f, it does not split"
            assert normalise("Read", lowercase=False) != normalise("read", lowercase=False)
        finally:
            await encoder.close()

    asyncio.run(scenario())


def test_the_minilm_tokenizer_lowercases_so_the_flag_is_safe_for_it() -> None:
    from transformers import AutoTokenizer

    from services.encoder.model import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    text = "Parse Command-Line ARGUMENTS in Ünïcode"
    assert tokenizer(text)["input_ids"] == tokenizer(normalise(text, True))["input_ids"]


def test_the_pipeline_encodes_each_distinct_miss_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One encoder call per batch, for the distinct texts the cache did not have; each
    text's key (normalised and hashed) is computed once, for the lookup, the grouping of
    the misses and the store alike."""
    from services.encoder.runtime.inprocess import InProcessEncoder
    from services.gateway import query_cache
    from services.gateway.generation_parts import Bundle
    from services.gateway.generations import GenerationSource
    from services.gateway.pipeline import SearchPipeline

    normalised: list[str] = []

    def counted(text: str, lowercase: bool = False) -> str:
        normalised.append(text)
        return normalise(text, lowercase)

    monkeypatch.setattr(query_cache, "normalise", counted)

    async def scenario() -> None:
        encoder = _Counting(InProcessEncoder.torch())
        cache = _cache(redis_url, dim=encoder.dim, lowercase=True)
        parts = Bundle("g1", encoder, None, None, None, None)  # type: ignore[arg-type]
        pipeline = SearchPipeline(GenerationSource.fixed(parts), query_cache=cache)
        try:
            texts = ["Alpha beta", "alpha  BETA", "gamma", "Alpha beta"]
            vectors, _, cached = await pipeline.embedder.embed(parts, texts, _deadline())
            assert encoder.calls == [["Alpha beta", "gamma"]] and cached == [False] * 4
            assert sorted(normalised) == sorted(texts), "one key per text, not one per use"
            np.testing.assert_array_equal(vectors[0], vectors[1])
            await cache.drain()
            vectors2, _, cached2 = await pipeline.embedder.embed(
                parts, ["gamma", "delta", "ALPHA beta"], _deadline()
            )
            assert encoder.calls[1:] == [["delta"]] and cached2 == [True, False, True]
            np.testing.assert_allclose(vectors2[0], vectors[2], atol=1e-6)
        finally:
            await cache.close()
            await encoder.close()

    asyncio.run(scenario())


def _deadline() -> Deadline:
    return Deadline.after(30.0)


def test_generations_of_one_encoder_share_entries_and_two_encoders_never_do(
    redis_url: str,
) -> None:
    """Index generations (issue #24): the pipeline keys each lookup on the serving
    generation's encoder (services/gateway/generation_parts.py encoder_identity: model, Triton
    version, digest). A query cached for one encoder is a miss for another, even of the
    same width; a second generation of the same encoder (a retrained quantizer) hits."""
    from services.gateway.generation_parts import encoder_identity

    class Triton:  # what identifies a Triton encoder: name, pinned version, digest
        def __init__(self, version: int, digest: str) -> None:
            self.model_name, self.model_version, self.digest = "embed-src", version, digest

    v1, v2 = encoder_identity(Triton(1, "aa")), encoder_identity(Triton(2, "bb"))  # type: ignore[arg-type]
    assert (v1, v2) == ("embed-src@1#aa", "embed-src@2#bb")

    async def scenario() -> None:
        cache = _cache(redis_url)
        try:
            cache.store(cache.keys(["q"], "query", encoder=v1), _vectors(1, 8, 0), [False])
            await cache.drain()
            assert await cache.lookup(cache.keys(["q"], "query", encoder=v2)) == [None]
            (hit,) = await cache.lookup(cache.keys(["q"], "query", encoder=v1))
            assert hit is not None
            np.testing.assert_array_equal(hit.vector, _vectors(1, 8, 0)[0])
            # another width is another entry
            assert await cache.lookup(cache.keys(["q"], "query", encoder=v1, dim=16), dim=16) == [
                None
            ]
        finally:
            await cache.close()

    asyncio.run(scenario())
