"""Gateway configuration: env vars GTR_GATEWAY_<FIELD> or flags --<field>."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.errors import RetrievalError
from services.common.fusion import Fusion, Method, Mode, RetrievalDefaults
from services.common.slo import SLOS
from services.encoder.runtime.triton_client import triton_addresses
from services.index.client.addresses import parse_shard_addresses
from services.rerank.depths import load_depth_table
from services.rpc.auth import Authenticator
from services.rpc.settings import ClientTLSSettings, RedisSettings
from services.rpc.tls import ClientTLS


class GatewaySettings(RedisSettings, ClientTLSSettings):
    model_config = SettingsConfigDict(env_prefix="GTR_GATEWAY_", extra="forbid")

    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="HTTP/JSON port: the same API transcoded by the protos' google.api.http "
        "rules (POST /v1/search, GET /v1/documents/{id}, ...; docs/http.md), with the same "
        "tokens, TLS, admission limit and metrics as the gRPC port; 0 picks a free one; "
        "unset = no HTTP port.",
    )
    shards: str = Field(
        "",
        description="Index shard replicas: 'host:port,host:port;host:port' "
        "(';' between shards, ',' between replicas of one shard), or per shard one DNS "
        "target 'dns:///name:port' whose addresses are its replicas (re-resolved every "
        "--resolve-every-s). These are index generation g1's shards (its shard count is the "
        "store's base); another generation's are read from the registry ({gtr}:addrs) when "
        "the alias names it (docs/generations.md). Empty: the base shard count is read from "
        "the store's key layout and g1's addresses, if g1 still serves, from {gtr}:addrs "
        "(required for a store with no key layout yet; leave it empty once g1 is retired).",
    )
    balance: Literal["least_outstanding", "round_robin"] = Field(
        "least_outstanding",
        description="Which replica of a shard a search goes to, and which Triton server an "
        "encode goes to: the one with the fewest calls in flight from this gateway (ties "
        "in turn), or strictly in turn.",
    )
    resolve_every_s: float = Field(
        5.0,
        gt=0,
        description="How often a shard or Triton named by a dns: target is resolved again.",
    )
    encoder: Literal["triton", "inprocess"] = Field(
        "triton", description="Where queries and documents are embedded."
    )
    triton_url: str = Field(
        "127.0.0.1:8001",
        description="Triton's KServe v2 gRPC address: 'host:port', several "
        "'host:port,host:port', or one DNS target 'dns:///name:port' (a headless Service) "
        "whose addresses are the servers (re-resolved every --resolve-every-s). Encodes "
        "are balanced over the servers (--balance) and fail over from one that is down.",
    )
    triton_model: str = Field("embed", description="Name of the embedding model in Triton.")
    query_repository: str | None = Field(
        None,
        description="Triton's CPU model repository, when this gateway can read it (the local "
        "stack's): queries are embedded in this process by the query graph of the version "
        "Triton serves, from the same folder (one thread; checked against Triton's vectors "
        "at start), documents still go to Triton. Saves a search the Triton hop (~6 ms on "
        "CPU, docs/performance.md). A version it cannot read or that differs (a GPU "
        "repository, a digest mismatch) keeps Triton, logged. Unset: Triton embeds both.",
    )
    hold_file: str | None = Field(
        None,
        description="A file listing a rollout's processes to pause while this gateway has a "
        "search in flight (the local stack's `up` writes it; services/process/hold.py): each "
        "is stopped when the first search in flight begins and continued when the last one "
        "ends, or after --hold-max-ms. Unset: nothing is paused.",
    )
    hold_max_ms: float = Field(
        250.0,
        gt=0,
        description="The longest one pause of --hold-file's processes lasts (ms): searches "
        "that overlap without a gap do not starve the rollout.",
    )
    model_dir: str | None = Field(
        None, description="In-process encoder: sentence-transformers dir (default model if unset)."
    )
    encoder_size: str = Field(
        "base",
        description="Encoder size (base/large/xl/xxl): a metrics label, and the latency "
        "SLOs this gateway runs under, from the one table the alert rules are generated "
        "from (services/common/slo.py; exported as gtr_slo_seconds).",
    )
    rerank_url: str | None = Field(None, description="RerankService address; unset = no rerank.")
    rerank_depth_table: str | None = Field(
        None,
        description="JSON from bench/rerank.py: ms per query at each rerank depth; unset = "
        "the table measured on 2 CPU cores (services/rerank/depths.py). A table that "
        "cannot be read stops the gateway at start.",
    )
    default_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Deadline of a request that brings none: every wait inside it (encoder, "
        "shards, Redis, rerank) is bounded by what is left of it.",
    )
    default_mode: Literal["dense", "sparse", "hybrid"] = Field(
        "hybrid",
        description="First stage of a search that names no mode: hybrid (dense and BM25 "
        "lists fused; the winner on SciFact's dev queries, docs/index.md), dense or sparse.",
    )
    fusion: Literal["weighted", "rrf"] = Field(
        "weighted",
        description="Fusion of a hybrid search that names none: weighted (min-max "
        "normalised scores) or rrf (reciprocal-rank fusion). A generation whose record "
        "carries a retrieval setting (`index rollout --retrieval-setting`) is served with "
        "its fusion and candidates instead of this, --rrf-k, --dense-weight and "
        "--hybrid-candidates.",
    )
    rrf_k: int = Field(60, ge=1, le=10_000, description="k of reciprocal-rank fusion.")
    dense_weight: float = Field(
        0.5, ge=0.0, le=1.0, description="Weight of the dense list in the weighted fusion."
    )
    hybrid_candidates: int = Field(
        100,
        ge=1,
        le=1000,
        description="Hits taken from each list of a hybrid search before fusing (at least "
        "k and the rerank depth).",
    )
    redis_max_connections: int = Field(
        64,
        ge=1,
        description="Connections to Redis at most; a request that finds them all busy waits "
        "(bounded by its deadline and redis_pool_timeout_s) instead of failing.",
    )
    redis_pool_timeout_s: float = Field(
        5.0, gt=0, description="Longest wait for a free Redis connection."
    )
    redis_wait_replicas: int = Field(
        0,
        ge=0,
        description="Acknowledge a write only once this many replicas of its Redis primary "
        "have it (WAIT after each write), so that it survives the primary's loss; 0 = "
        "as soon as the primary has it. Cost: docs/performance.md, 'Redis WAIT'.",
    )
    redis_wait_timeout_ms: int = Field(
        1000,
        ge=0,
        description="Longest WAIT for the replicas; fewer acknowledged in time = UNAVAILABLE "
        "(the write is on the primary; retrying it is safe).",
    )
    redis_read_retry_s: float = Field(
        3.0,
        ge=0,
        description="How long a read (document fetch, log tails) keeps retrying while Redis "
        "cannot be reached (a restart), within the request's deadline; then UNAVAILABLE.",
    )
    hedge: bool = Field(
        True,
        description="Send a search also to another replica of a shard when the first is "
        "slower than its recent p95 (the first answer wins).",
    )
    query_cache: bool = Field(
        False,
        description="Keep query embeddings in Redis (key: model, size, kind and the "
        "normalised text) so that a repeated query skips the encoder; the response's "
        "embedding_cached says when. A cache error never fails a search (it is encoded).",
    )
    query_cache_redis_url: str | None = Field(
        None,
        description="Redis of the query cache (one Redis or redis+cluster://); unset = "
        "--redis-url. The cache needs no durability: a Redis without AOF suits it.",
    )
    query_cache_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="Lifetime of a cached embedding from its insert (hits do not extend "
        "it), so a model replaced under the same name is picked up within it.",
    )
    query_cache_max_entries: int = Field(
        50_000,
        ge=1,
        description="Most cached embeddings; past it the least recently used are evicted. "
        "An entry costs about dim x 4 + 200 bytes (MiniLM: ~1.7 KB, GTR: ~3.3 KB).",
    )
    query_cache_timeout_ms: float = Field(
        50.0,
        gt=0,
        description="A cache lookup slower than this is given up (counted as an error) "
        "and the queries are encoded; after an error the cache is bypassed for a second.",
    )
    query_cache_lowercase: bool = Field(
        False,
        description="Lowercase texts in the cache key: only for an uncased model whose "
        "tokenizer lowercases anyway (all-MiniLM-L6-v2 yes, GTR no).",
    )
    client_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of --max-in-flight one client may hold once in-flight units pass "
        "--shed-high-water: its next call is refused RESOURCE_EXHAUSTED with the hint, so "
        "one client's burst leaves room for the others. A client is its bearer token, else "
        "its connection; its first call is never refused by its share. 1 = no share.",
    )
    shed_high_water: float = Field(
        0.75,
        gt=0,
        le=1,
        description="Share of --max-in-flight above which optional work is shed: the "
        "rerank depth shrinks as in-flight requests rise past it and the rerank is skipped "
        "(said in the response) at the limit, before any search is refused.",
    )
    alias_refresh_ms: float = Field(
        500.0,
        ge=10,
        le=60_000,
        description="How often the index generations alias ({gtr}:alias: which generation "
        "serves, docs/generations.md) is read again in the background; it is also read at "
        "once when a write finds its generation moved or a write token names a newer epoch. "
        "Searches use the cached alias: no Redis round trip per request.",
    )
    quantizer_threads: int = Field(
        1,
        ge=1,
        description="OpenMP threads of the shared coarse quantizer (one pass per wave of "
        "searches); more only when the gateway has idle cores.",
    )

    read_tokens_file: str | None = Field(
        None,
        description="Bearer tokens that may search and get (Search, BatchSearch, Get): one "
        "per line, blank lines and # comments ignored; re-read when the file changes.",
    )
    write_tokens_file: str | None = Field(
        None,
        description="Bearer tokens that may also write (Upsert, Delete); same format. "
        "Without a tokens file the gateway needs --no-auth to start.",
    )
    auth: bool = Field(
        True,
        description="Require bearer tokens (the token files). --no-auth (env "
        "GTR_GATEWAY_AUTH=false) runs without authentication: every client may read and "
        "write. Only when that is meant (a gateway on loopback); never with token files.",
    )
    tokens_reload_s: float = Field(
        1.0, gt=0, description="How often a request may check the token files for a change."
    )
    triton_tls: bool = Field(
        True,
        description="Use the --tls-ca/--tls-client-* settings for Triton too (Triton started "
        "with --grpc-use-ssl); false: plaintext to a Triton without TLS.",
    )

    @model_validator(mode="after")
    def _ports_differ(self) -> GatewaySettings:
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"--http-port and --port are both {self.port}: give two ports")
        return self

    @model_validator(mode="after")
    def _auth_configured(self) -> GatewaySettings:
        files = self.read_tokens_file or self.write_tokens_file
        if not self.auth and files:
            raise ValueError("--no-auth and a tokens file contradict each other: give one")
        if self.auth:
            if not files:
                raise ValueError(
                    "no tokens: give --read-tokens-file and/or --write-tokens-file (one token "
                    "per line), or --no-auth to run without authentication"
                )
            self.authenticator()  # readable, and holds a token
        return self

    def authenticator(self) -> Authenticator | None:
        """The token sets (None with --no-auth)."""
        if not self.auth:
            return None
        return Authenticator.from_files(
            self.read_tokens_file, self.write_tokens_file, self.tokens_reload_s
        )

    def retrieval_defaults(self) -> RetrievalDefaults:
        """What a search that names no mode or fusion gets."""
        return RetrievalDefaults(
            Mode(self.default_mode),
            Fusion(Method(self.fusion), rrf_k=self.rrf_k, dense_weight=self.dense_weight),
            self.hybrid_candidates,
        )

    def triton_client_tls(self) -> ClientTLS | None:
        """TLS of the channel to Triton: :meth:`client_tls` unless ``triton_tls`` is off."""
        return self.client_tls() if self.triton_tls else None

    @field_validator("encoder_size")
    @classmethod
    def _known_size(cls, value: str) -> str:
        if value not in SLOS:
            raise ValueError(f"unknown encoder size {value!r}; known: {', '.join(SLOS)}")
        return value

    @field_validator("shards")
    @classmethod
    def _valid_shards(cls, value: str) -> str:
        if value:
            parse_shard_addresses(value)
        return value

    @field_validator("triton_url")
    @classmethod
    def _valid_triton_url(cls, value: str) -> str:
        triton_addresses(value)
        return value

    @field_validator("rerank_depth_table")
    @classmethod
    def _readable_depth_table(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                load_depth_table(Path(value))
            except RetrievalError as exc:
                raise ValueError(exc.message) from None
        return value
