"""Reranker configuration: env vars GTR_RERANK_<FIELD> or flags --<field>."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.rpc.settings import ServiceSettings


class RerankSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="GTR_RERANK_", extra="forbid")

    port: int = Field(50071, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    checkpoint: str | None = Field(
        None,
        description="Checkpoint directory written by `rerank train`; unset = an UNTRAINED "
        "CELI head on the default backbone (all-MiniLM-L6-v2), logged as such.",
    )
    checkpoint_dir: str | None = Field(
        None,
        description="A directory of checkpoints (each a `rerank train` output folder): a "
        "request naming one by its folder name (RerankRequest.checkpoint, what a "
        "generation's retrieval setting names) is scored by it, loaded on first use; "
        "unset = only the default model is served, a named one is NOT_FOUND.",
    )
    max_loaded: int = Field(
        2,
        ge=1,
        le=64,
        description="Checkpoints of --checkpoint-dir kept in memory at most (least recently "
        "used dropped first; the default model is not counted).",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Torch device.")
    batch_size: int = Field(16, ge=1, le=1024, description="Pairs per forward pass.")
    threads: int | None = Field(
        None, ge=1, le=256, description="torch intra-op threads (process-wide); unset = torch's."
    )
