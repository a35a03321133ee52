"""Request limits of the public API (also written in the .proto comments)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_query_bytes: int = 8192
    max_k: int = 1000
    max_batch_queries: int = 64
    max_rerank_depth: int = 1000
    max_nprobe: int = 65536
    max_filter_conditions: int = 16
    max_filter_values: int = 1024
    max_key_bytes: int = 128
    max_upsert_documents: int = 256
    max_delete_ids: int = 1024
    max_id_bytes: int = 256
    max_text_bytes: int = 1 << 20
    max_metadata_keys: int = 32
    max_metadata_value_bytes: int = 1024
