"""Every request limit of the service, in one place (also written in the .proto comments).

The gateway checks a public request where it enters (``services.gateway.validation``), a
shard a search in ``IvfPqShard.check``, the change log's writer its records; the router
checks ``k`` and the write token's shards again for reasons of its own (docs/architecture.md,
"Follow one search"). They all read these numbers, so a limit cannot differ between the hops.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_query_bytes: int = 8192
    max_k: int = 1000  # hits per query, at the gateway and at a shard
    max_batch_queries: int = 64  # searches per BatchSearch
    # k summed over a BatchSearch: the hits of ten k=1000 Searches (64 x 156). 64 x 1000
    # built a 6.8 MB answer of stdlib documents; at most 10,000 hits is ~1 MB of those,
    # but an answer with long documents can still pass a default client's 4 MB receive
    # limit (as one Search at k=1000 can): our clients receive up to the gateway's
    # --max-message-mb, and search.proto tells other clients to (or to ask ids_only).
    max_batch_hits: int = 10_000
    max_shard_queries: int = 256  # query vectors per shard request (a coalesced wave)
    max_rerank_depth: int = 1000
    max_nprobe: int = 65536
    max_filter_conditions: int = 16
    max_filter_values: int = 1024
    max_key_bytes: int = 128
    max_upsert_documents: int = 256
    max_delete_ids: int = 1024  # also the most documents of one change-log write
    max_id_bytes: int = 256
    max_text_bytes: int = 1 << 20
    max_query_terms: int = 256  # distinct analysed terms of a sparse (BM25) query
    max_metadata_keys: int = 32
    max_metadata_value_bytes: int = 1024


LIMITS = Limits()

# The name the router and the shard core check ``k`` against; here, not in the shard core,
# so the gateway's router reads it without loading the shard (tantivy, the GPU code).
MAX_K = LIMITS.max_k
