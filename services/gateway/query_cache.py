"""The query-embedding cache: a query's embedding kept in Redis, so that a query asked
again skips the encoder (Triton) round trip.

An entry is keyed by what decides the embedding: the encoder (its model name, and with
Triton the model version and digest of the generation that asks: two index generations
of one encoder share their entries, two encoders never do; docs/generations.md), the
size profile, the embedding width, the input kind (query/document) and the normalised
text (a SHA-256 of them; see :func:`normalise`). Its value is one flag byte (the text
was truncated to the model's query length) and the little-endian float32 vector.

* **TTL** (``ttl_s``): fixed from the insert, never refreshed by a hit, so that an
  embedding is recomputed at least once per TTL (a model replaced under the same name
  is picked up within it).
* **Size bound** (``max_entries``): Redis' ``maxmemory`` is global (it would evict
  documents too), so the cache bounds itself. A sorted set holds every entry's key,
  scored by its last use (Redis' own clock, ``TIME``); an insert adds its entries, drops
  the members that are surely expired (last used more than a TTL ago) and then pops the
  least recently used members, deleting their entries, until at most ``max_entries``
  remain. Lookup and insert are each one Lua script, atomic in Redis, so the bound holds
  under any number of concurrent gateways: every live entry is a member of the set, and
  the set is never left above the bound. A hit rewrites its score only when it is older
  than ``touch_s`` (a tenth of the TTL, at most a minute): LRU to that granularity, and
  most hits write nothing (on a Redis with ``appendfsync always`` a write is an fsync).
* **Redis Cluster**: every key carries the hash tag ``{gtr-qcache}``, so the scripts'
  keys are in one slot.
* **Never fails a search**: a lookup is bounded by ``timeout_s`` (and the request's
  deadline); a Redis error or a slow lookup is counted and the queries are encoded as if
  they had missed. After an error the cache is bypassed for ``backoff_s`` (counted too),
  so that a Redis that is down costs searches nothing. Inserts run in the background
  after the response; their failures are counted.

No grpc here; the gateway pipeline computes each text's entry key once
(:meth:`QueryEmbeddingCache.keys`: NFC, whitespace and a SHA-256 per text), then calls
:meth:`QueryEmbeddingCache.lookup` with the keys before the encoder, groups its misses by
key, and :meth:`QueryEmbeddingCache.store` the keys of the misses with what the encoder
returned.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from services.encoder.profiles import Kind
from services.gateway.metrics import QueryCacheMetrics
from services.process.redis_client import async_client

log = logging.getLogger(__name__)

HASH_TAG = "{gtr-qcache}"
KEY_PREFIX = f"qcache:{HASH_TAG}:"
LRU_KEY = KEY_PREFIX + "lru"
# Background inserts at most in flight; more are dropped (and counted), not queued.
MAX_PENDING_STORES = 64

# The whitespace every tokenizer we serve splits on and never keeps: ASCII space, tab,
# newline, carriage return and the Unicode space separators (category Zs). BERT's
# normaliser maps them to a space and splits there; T5's SentencePiece (nmt_nfkc) folds
# them to a space and removes runs of them. Other control characters (\f, \v, \x1c..)
# are not collapsed: BERT deletes them instead of splitting, so "a\fb" reads as "ab".
_SPACE_RUN = re.compile(
    "[ \t\n\r\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]+",
)

# KEYS[1]: the LRU set, KEYS[2..]: the entries; ARGV[1]: the touch interval in ms.
# Returns each entry's value or nil; a hit becomes the most recently used (its score is
# rewritten only when older than the touch interval: most hits write nothing, so they
# cost no AOF write and fsync), a miss leaves the set (its entry expired).
_LOOKUP = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local touch = tonumber(ARGV[1])
local out = {}
for i = 2, #KEYS do
  local value = redis.call('GET', KEYS[i])
  if value then
    local used = redis.call('ZSCORE', KEYS[1], KEYS[i])
    if (not used) or now - tonumber(used) >= touch then
      redis.call('ZADD', KEYS[1], now, KEYS[i])
    end
    out[i - 1] = value
  else
    redis.call('ZREM', KEYS[1], KEYS[i])
    out[i - 1] = false
  end
end
return out
"""

# KEYS[1]: the LRU set, KEYS[2..]: the entries; ARGV[1]: TTL in ms, ARGV[2]: the bound,
# ARGV[3..]: the values. Returns how many entries were evicted to keep the bound.
_INSERT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local bound = tonumber(ARGV[2])
for i = 2, #KEYS do
  redis.call('SET', KEYS[i], ARGV[i + 1], 'PX', ttl)
  redis.call('ZADD', KEYS[1], now, KEYS[i])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - ttl))
local over = redis.call('ZCARD', KEYS[1]) - bound
local evicted = 0
if over > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[1], over)
  for j = 1, #popped, 2 do
    redis.call('DEL', popped[j])
    evicted = evicted + 1
  end
end
redis.call('PEXPIRE', KEYS[1], ttl)
return evicted
"""


def normalise(text: str, lowercase: bool = False) -> str:
    """The text as the encoder effectively reads it: Unicode NFC, runs of whitespace as
    one space, no leading or trailing whitespace; lowercased only for an uncased model
    (whose tokenizer lowercases anyway: all-MiniLM-L6-v2's BERT tokenizer does, GTR's T5
    SentencePiece does not). NFC is invisible to both tokenizers (T5 applies NFKC, an
    uncased BERT NFD), so two texts with one normal form share one embedding."""
    out = _SPACE_RUN.sub(" ", unicodedata.normalize("NFC", text)).strip(" ")
    # one character at a time, as the tokenizer does: str.lower() would give a capital
    # sigma at a word's end the final form, which the tokenizer reads as another token
    return "".join(c.lower() for c in out) if lowercase else out


@dataclass(frozen=True)
class CachedEmbedding:
    vector: np.ndarray  # float32 (dim,)
    truncated: bool


class QueryEmbeddingCache:
    """Embeddings of (model, size, kind, normalised text) in Redis, bounded and expiring."""

    def __init__(
        self,
        redis_url: str,
        *,
        model: str,
        size: str,
        dim: int,
        ttl_s: float,
        max_entries: int,
        timeout_s: float = 0.05,
        lowercase: bool = False,
        backoff_s: float = 1.0,
        touch_s: float | None = None,
        max_connections: int = 64,
        metrics: QueryCacheMetrics | None = None,
    ) -> None:
        if ttl_s <= 0 or max_entries < 1 or dim < 1 or timeout_s <= 0:
            raise ValueError("query cache: ttl_s, max_entries, dim and timeout_s must be > 0")
        self.model = model
        self.size = size
        self.dim = dim
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.max_entries = max_entries
        # LRU to this granularity: default a tenth of the TTL, at most a minute
        self.touch_ms = round(1000 * (min(60.0, ttl_s / 10) if touch_s is None else touch_s))
        self.timeout_s = timeout_s
        self.lowercase = lowercase
        self.backoff_s = backoff_s
        self.metrics = metrics
        # A client of its own (one Redis or a Redis Cluster, by the URL) with short
        # socket timeouts; every call is bounded by the lookup timeout besides, so a
        # slow or absent Redis never holds a search.
        self._redis: Any = async_client(
            redis_url,
            max_connections=max_connections,
            pool_timeout_s=timeout_s,
            socket_timeout=timeout_s * 4,
        )
        self._lookup = self._redis.register_script(_LOOKUP)
        self._insert = self._redis.register_script(_INSERT)
        self._pending: set[asyncio.Task[None]] = set()
        self._bypass_until = 0.0

    def key(self, text: str, kind: Kind, encoder: str | None = None, dim: int | None = None) -> str:
        """The entry of ``text`` embedded as ``kind`` by ``encoder`` (its identity,
        :func:`services.gateway.generation_parts.encoder_identity`; default this cache's
        model) of width ``dim`` (default this cache's), in this cache's size."""
        ident = "\x00".join((encoder or self.model, self.size, str(dim or self.dim), kind))
        digest = hashlib.sha256(
            (ident + "\x00" + normalise(text, self.lowercase)).encode("utf-8", "surrogatepass")
        ).hexdigest()
        return KEY_PREFIX + digest

    def keys(
        self, texts: Sequence[str], kind: Kind, encoder: str | None = None, dim: int | None = None
    ) -> list[str]:
        """The entry key of each text, computed once and passed to lookup and store."""
        return [self.key(t, kind, encoder, dim) for t in texts]

    def _count(self, result: str, n: int = 1) -> None:
        if self.metrics is not None and n:
            self.metrics.lookups.labels(result).inc(n)

    def _failed(self, op: str, exc: BaseException) -> None:
        self._bypass_until = time.monotonic() + self.backoff_s
        if self.metrics is not None:
            self.metrics.errors.labels(op).inc()
        log.warning("query cache %s failed (bypassed for %.1f s): %r", op, self.backoff_s, exc)

    async def lookup(
        self, keys: Sequence[str], timeout: float | None = None, dim: int | None = None
    ) -> list[CachedEmbedding | None]:
        """Each key's (:meth:`keys`) cached embedding or None, in one round trip. Never
        raises (but for cancellation): an error or a lookup slower than ``timeout_s`` (or
        ``timeout``) answers all None."""
        if not keys:
            return []
        if time.monotonic() < self._bypass_until:
            self._count("bypassed", len(keys))
            return [None] * len(keys)
        # Cut short by the request's own deadline, a timeout says nothing about Redis: it
        # must not bypass the cache for every other search.
        cut_by_deadline = timeout is not None and timeout < self.timeout_s
        limit = max(0.0, timeout) if cut_by_deadline and timeout is not None else self.timeout_s
        try:
            async with asyncio.timeout(limit):
                values = await self._lookup(keys=[LRU_KEY, *keys], args=[self.touch_ms])
        except (redis.RedisError, OSError, TimeoutError) as exc:
            # redis-py turns the cancelled read into its own TimeoutError (a RedisError)
            if not (cut_by_deadline and isinstance(exc, TimeoutError | redis.TimeoutError)):
                self._failed("lookup", exc)
            self._count("error", len(keys))
            return [None] * len(keys)
        found = [self._decode(v, dim or self.dim) for v in values]
        hits = sum(f is not None for f in found)
        self._count("hit", hits)
        self._count("miss", len(found) - hits)
        return found

    def _decode(self, value: bytes | None, dim: int) -> CachedEmbedding | None:
        if value is None or len(value) != 1 + 4 * dim:
            return None
        vector = np.frombuffer(value, dtype="<f4", offset=1).astype(np.float32)
        return CachedEmbedding(vector, value[0] == 1)

    def store(self, keys: Sequence[str], vectors: np.ndarray, truncated: Sequence[bool]) -> None:
        """Insert the embeddings under their keys (:meth:`keys`) in the background (the
        search does not wait for it)."""
        if not keys:
            return
        if len(self._pending) >= MAX_PENDING_STORES or time.monotonic() < self._bypass_until:
            if self.metrics is not None:
                self.metrics.stores.labels("dropped").inc(len(keys))
            return
        entries: dict[str, bytes] = {}
        for key, row, cut in zip(keys, vectors, truncated, strict=True):
            flag = b"\x01" if cut else b"\x00"
            entries[key] = flag + np.asarray(row, dtype="<f4").tobytes()
        task = asyncio.get_running_loop().create_task(self._store(entries))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _store(self, entries: dict[str, bytes]) -> None:
        args: list[int | bytes] = [self.ttl_ms, self.max_entries, *entries.values()]
        try:
            async with asyncio.timeout(self.timeout_s * 4):
                evicted = await self._insert(keys=[LRU_KEY, *entries], args=args)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._failed("store", exc)
            return
        if self.metrics is not None:
            self.metrics.stores.labels("stored").inc(len(entries))
            self.metrics.evictions.inc(int(evicted))

    async def drain(self) -> None:
        """Wait for the background inserts started so far."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        await self._redis.aclose()
