"""Shard replica configuration: env vars GTR_SHARD_<FIELD> or flags --<field>."""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.index.core.text import TextConfig, check_language
from services.index.records import generation_number
from services.rpc.settings import ClientTLSSettings, RedisSettings


class ShardSettings(RedisSettings, ClientTLSSettings):
    model_config = SettingsConfigDict(env_prefix="GTR_SHARD_", extra="forbid")

    port: int = Field(50061, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    shard: int = Field(..., ge=0, description="Which shard this replica serves (0..shards-1).")
    shards: int = Field(..., ge=1, le=4096, description="Number of shards (fixed at creation).")
    generation: str = Field(
        "g1",
        description="The index generation this replica serves (docs/generations.md): its "
        "logs, snapshot registrations and trained index; g1 is the store's first. Another "
        "generation must be in the registry, with this shard count.",
    )
    replica: str = Field(
        default_factory=socket.gethostname,
        description="Stable replica name (the pod name); keys its snapshot position.",
    )
    index_dir: str = Field(..., description="Directory of the trained index (`index train`).")
    snapshot_dir: str = Field(..., description="This replica's snapshot directory.")
    snapshot_every_entries: int = Field(20_000, ge=1, description="Snapshot after N changes.")
    snapshot_every_s: float = Field(60.0, gt=0, description="…or after this many seconds.")
    keep_snapshots: int = Field(3, ge=1, description="Snapshots kept on disk.")
    heartbeat_s: float = Field(
        30.0, gt=0, description="Re-register this replica's log floor (and that it is alive)."
    )
    stale_replica_s: float = Field(
        86_400.0,
        gt=0,
        description="A replica of the shard unseen this long is taken as removed: it no "
        "longer holds log trimming back (it must re-seed from a peer's snapshot to return).",
    )
    search_threads: int = Field(
        2,
        ge=0,
        description="Threads running FAISS searches; 0 = inline on the event loop (best "
        "when the shards already outnumber the cores, see docs/index.md).",
    )
    omp_threads: int = Field(
        1, ge=1, description="Threads per FAISS call (OpenMP) and per numpy BLAS call."
    )
    gpu: bool = Field(
        True, description="Serve searches from a GPU copy when faiss sees a GPU (else CPU)."
    )
    gpu_device: int = Field(0, ge=0, description="GPU device of the copy.")
    ready_timeout_s: float = Field(1800.0, gt=0, description="Max time to replay the log.")
    read_count: int = Field(512, ge=1, description="Log entries per XREAD of the consumer.")
    block_ms: int = Field(50, ge=1, description="Longest wait of one XREAD for new entries.")
    default_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Deadline of a search that brings none (its consistency wait included), "
        "and of a Stats call's wait for a log position (applied_at_least).",
    )
    peers: str | None = Field(
        None,
        description="The other replicas of this shard, to seed from when this one starts "
        "with no usable snapshot and the log was trimmed past it: 'host:port,host:port', "
        "or 'dns:///name:port' (the shard's headless Service). Unset: such a start fails.",
    )
    seed_timeout_s: float = Field(
        600.0, gt=0, description="How long seeding from a peer may take, retries included."
    )
    text_index: bool = Field(
        True,
        description="Keep a BM25 (Tantivy) text index beside the vectors, fed by the same "
        "log and snapshots, for sparse and hybrid searches; off: dense only.",
    )
    text_refresh_s: float = Field(
        0.25,
        ge=0,
        description="How often applied log entries become searchable in the text index "
        "(a Tantivy commit, ~10 ms of CPU however few the changes); the vectors are at "
        "once, a SESSION search's write at once too. 0: a commit per applied batch.",
    )
    text_language: str = Field(
        "english",
        description="Stemmer of the text index (Tantivy's Snowball languages, or 'none'); "
        "fixed for the life of the shard's snapshots.",
    )
    text_dir: str | None = Field(
        None,
        description="Working directory of the text index (default: <snapshot-dir>/text, "
        "beside the snapshots on the same volume).",
    )

    @field_validator("generation")
    @classmethod
    def _generation_name(cls, value: str) -> str:
        generation_number(value)  # ValueError: "x is not a generation name (g1, g2, ...)"
        return value

    _text_language = field_validator("text_language")(check_language)

    def text_config(self) -> TextConfig | None:
        """Where and how the text index lives (None: ``--no-text-index``)."""
        if not self.text_index:
            return None
        root = Path(self.text_dir) if self.text_dir else Path(self.snapshot_dir) / "text"
        return TextConfig(root, self.text_language)

    @model_validator(mode="after")
    def _shard_in_range(self) -> ShardSettings:
        if self.shard >= self.shards:
            raise ValueError(f"shard {self.shard} does not exist: shards are 0..{self.shards - 1}")
        return self
