"""A replica process of one shard.

``replica``
    the in-memory shard kept in step with its Redis Stream (the log consumer).
``refresh``
    when the consumer makes what it applied searchable in the text index.
``folders``
    a snapshot folder belongs to one index generation.
``seeding``
    a replica that cannot replay its log seeds itself from a ready peer's snapshot.
``batcher``
    micro-batching: concurrent single-query searches become one FAISS call.
``service``
    what a replica answers, free of grpc: consistency waits, then a batched search.
``servicer``
    ``IndexShardService`` over grpc.aio: proto → domain → service → proto.
``metrics``
    the shard's metrics on an injected registry (gauges read the shard on scrape).
``settings``
    the replica's configuration (``GTR_SHARD_<FIELD>`` or ``--<field>``).
``process``
    the process: load, replay the log, serve (``gtr-retrieval index serve``).
"""
