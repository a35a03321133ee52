"""What ``gtr-retrieval up`` starts, and where it keeps its files."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from services.stack.children import RestartPolicy

# Redis AOF fsync policy: "always" fsyncs every write before acknowledging it (an
# acknowledged upsert survives a power loss); "everysec" can lose the last second.
RedisFsync = Literal["always", "everysec"]


STDLIB_EXAMPLES = (
    "read a csv file",
    "parse command line arguments",
    "run a function in a thread pool",
    "compute a sha256 hash of bytes",
)
EXAMPLES_FROM_QUERIES = 3

# Admission units (``--max-in-flight``) per core of the machine ``up`` runs on.
IN_FLIGHT_PER_CORE = 16


def default_max_in_flight() -> int:
    """``up``'s admission limit for the gateway and the shards: :data:`IN_FLIGHT_PER_CORE`
    (16) units per CPU this process may run on (``os.sched_getaffinity``).

    Why 16 per core (docs/performance.md, "Load" and "Overload"): a search costs ~7.6 ms
    of CPU over every process of the stack (Triton 5.0, gateway 1.5, shards 0.4 each,
    Redis 0.07) and takes ~15 ms at p50 on an idle stack, so about two searches in flight
    keep one core busy; closed-loop callers reach the stack's throughput ceiling (203-232
    searches/s on 2 cores) at 16 in flight, i.e. 8 per core, and more in flight only
    queue. Twice that, 16 per core, leaves room for the waits that cost no CPU (a session
    search waiting for the log, Redis round trips) while still refusing a burst early:
    on 2 cores it gives 32, the limit with which ``bench.overload`` measured 1,000
    concurrent k=1000 searches refused RESOURCE_EXHAUSTED with ``retry-after-ms`` in time
    (0 DEADLINE_EXCEEDED), where without a limit such bursts end DEADLINE_EXCEEDED."""
    return IN_FLIGHT_PER_CORE * max(1, len(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class StackConfig:
    run_dir: Path = Path(".run")
    corpus: Path | None = None  # None = the embedded stdlib documentation corpus
    shards: int = 2
    replicas: int = 1
    encoder: Literal["triton", "inprocess"] = "triton"
    # Triton's query tower: "int8" = the export's int8 query graph (query_int8.py), refused
    # with its gates; "auto" = int8 when its gates pass, else FP32, and for a run dir
    # whose first `up` exported FP32, FP32 (triton_component.onnx_export); the in-process
    # encoder (PyTorch) is FP32 whatever this says
    query_precision: Literal["auto", "fp32", "int8"] = "auto"
    # documents through the same int8 graph (document_int8.py; needs int8 queries):
    # "auto" = when its gates pass, and for a run dir whose first `up` exported FP32
    # documents, FP32 (its stored vectors are FP32's). None (the default): the run dir's
    # export, else FP32: through the stack int8 documents cost hybrid RRF 0.012 dev
    # nDCG@10 (docs/performance.md)
    document_precision: Literal["auto", "fp32", "int8"] | None = None
    # who runs a query's graph with the Triton encoder: the gateway, from the model
    # repository's version Triton serves (services/encoder/runtime/local_queries.py), or
    # Triton; documents always go to Triton
    query_encoder: Literal["gateway", "triton"] = "gateway"
    # Triton's session nice while it encodes only documents (query_encoder "gateway"):
    # a search's work runs before a write's encode when both want a CPU (docs/performance.md
    # "Searches before document encodes"); 0 = the same weight as the rest
    triton_nice: int = 10
    rerank: bool = True
    rerank_checkpoint: Path | None = None
    rerank_checkpoint_dir: Path | None = (
        None  # checkpoints served by name (rerank --checkpoint-dir)
    )
    gateway_port: int = 50051  # 0 = a free port
    # the gateway's HTTP/JSON port (docs/http.md); 0 = a free port, None = none
    http_port: int | None = 8080
    host: str = "127.0.0.1"
    # None: fit the corpus (the stdlib queries below for the default corpus; the first
    # queries of a queries.jsonl beside a custom corpus, as in BEIR folders; else none)
    examples: tuple[str, ...] | None = None
    prometheus: bool = True  # when the prometheus binary is installed
    serve: bool = True  # False: stop after ingest + examples (used by the tests)
    train_sample: int = 5000  # enough for nlist ≈ 4·√N up to ~100k documents
    ingest_batch: int = 64
    progress: bool = True
    startup_timeout_s: float = 300.0
    redis_fsync: RedisFsync = "always"
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # when children restart
    # bearer tokens at the gateway: off by default (loopback only); on, a read and a
    # write token are generated into auth_dir
    auth: bool = False
    # a throwaway CA in tls_dir: TLS on the gateway, mTLS between our services and Triton
    tls: bool = False
    # the gateway's query-embedding cache (in the stack's Redis); None: the gateway's default
    query_cache: bool = False
    query_cache_ttl_s: float | None = None
    query_cache_max_entries: int | None = None
    # admission limit of the gateway and of every shard replica (0 = none): units of
    # ``--max-in-flight`` (a search one per 25 hits), by default derived from the cores
    max_in_flight: int = field(default_factory=default_max_in_flight)
    # OpenTelemetry (docs/tracing.md): the OTLP/gRPC collector every child of ours sends
    # its spans to (None: tracing off), the share of new traces recorded, and Triton's
    # OTLP/HTTP endpoint (its build exports over HTTP only; None: Triton not traced)
    otlp_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    triton_otlp_endpoint: str | None = None
    # shard processes forked from one that imported their libraries once (the fork server,
    # services/stack/forking.py) rather than each a fresh interpreter (``--no-fork-shards``)
    fork_shards: bool = True

    @property
    def auth_dir(self) -> Path:
        return self.run_dir / "auth"

    @property
    def redis_password_file(self) -> Path:
        """``--auth``: the local Redis's password (made on first use, mode 0600)."""
        return self.auth_dir / "redis.password"

    @property
    def redis_config_file(self) -> Path:
        """``--auth``: the redis.conf holding ``requirepass`` (mode 0600; a password on
        redis-server's command line would be visible to every local user in ``ps``)."""
        return self.auth_dir / "redis.conf"

    @property
    def redis_url_file(self) -> Path:
        """How every child reaches the local Redis (password, ``rediss://`` and the run's
        certificates included): written at each start, mode 0600, read by the gateway and
        the shards through ``--redis-url-file``."""
        return self.run_dir / "redis.url"

    @property
    def tls_dir(self) -> Path:
        return self.run_dir / "tls"

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    @property
    def redis_dir(self) -> Path:
        return self.run_dir / "redis"

    @property
    def model_repository(self) -> Path:
        return self.run_dir / "model_repository"

    @property
    def index_dir(self) -> Path:
        return self.run_dir / "index"

    @property
    def index_root(self) -> Path:
        """Where ``index rollout --run-dir`` puts a new generation's trained index
        (``<index_root>/<generation>``); generation g1's is :attr:`index_dir`."""
        return self.run_dir / "generations"

    def snapshot_dir(self, shard: int, replica: int, generation: str = "g1") -> Path:
        """A replica's snapshots: g1's where they always were, another generation's in
        a folder of its own (removed when the generation is retired)."""
        name = f"shard-{shard}-replica-{replica}"
        if generation == "g1":
            return self.run_dir / "snapshots" / name
        return self.generation_snapshots(generation) / name

    def generation_snapshots(self, generation: str) -> Path:
        return self.run_dir / "snapshots" / generation


def example_queries(cfg: StackConfig) -> tuple[str, ...]:
    """The example searches ``up`` prints: ones that fit the corpus it ingested."""
    import json

    if cfg.examples is not None:
        return cfg.examples
    if cfg.corpus is None:
        return STDLIB_EXAMPLES
    queries = cfg.corpus.parent / "queries.jsonl"
    if not queries.exists():
        return ()
    out: list[str] = []
    with queries.open(encoding="utf-8") as fh:
        for line in fh:
            try:
                row = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError:
                continue  # a broken line is no example; the corpus itself was read fine
            text = row.get("text", "") if isinstance(row, dict) else ""
            if isinstance(text, str) and text.strip():
                out.append(text.strip())
            if len(out) == EXAMPLES_FROM_QUERIES:
                break
    return tuple(out)
