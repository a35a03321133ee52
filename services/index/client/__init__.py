"""What the gateway uses of the index.

Package map:

- ``router``: the fan-out of a search to every shard (validation, shared quantizer).
- ``merge``: the merge of the shards' answers into one top-k per query (pure).
- ``coalescer``: concurrent single-query searches sent to the shards in waves.
- ``replicas``: a shard's replicas (balancing, failover, hedging, the search stream).
- ``writer``: the change log's writer (documents and their log entries).
- ``late_vectors``: a dual encode's rows kept after its upsert was written (the catch-up
  reads them).
- ``documents``: the reader of the stored documents.
- ``tails``: the reader of the logs' tails (what a STRONG search waits for).
- ``connection``: the Redis connection those three share.
- ``addresses``: shard addresses as the flags and the store give them, parsed.
- ``export``: the vectors a shard replica holds, read over ``ExportVectors``.
"""
