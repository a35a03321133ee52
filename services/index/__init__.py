"""The index: sharded FAISS IVF-PQ over a Redis change log, in these roles.

``core/``
    the shard itself, no grpc: IVF-PQ + SQ8 refine (``shard``; its preassigned scan and
    refine: ``scan``; its metadata tags: ``tags``; its PQ drift window: ``pq_drift``),
    FAISS id → slot (``slots``), snapshots and the shard's state codec (``snapshots``),
    training, the shared coarse quantizer, the changes a log entry carries, the search
    request and its answer grid (``query``).
``server/``
    a replica process of one shard: the log consumer (``replica``), micro-batched
    searches (``batcher``), consistency waits (``service``), the gRPC servicer and the
    process (``process``, run by ``gtr-retrieval index serve``).
``client/``
    what the gateway uses: the router (fan-out: ``router``; merge: ``merge``;
    coalescing: ``coalescer``), a shard's replicas
    (failover, hedging), the search stream, the change-log writer, the readers of the
    stored documents and of the logs' tails, and the Redis connection those three share.
``changelog``, ``convert``
    the contracts both sides share: the entry format and reader of the log; protobuf ↔
    core conversions of the internal API.
``keys``, ``layout``, ``migrate``
    where the documents and logs live in Redis (the key layout), the layout version each
    service checks at start, and the rewrite of a layout-1 store.
``records``
    a generation's record as the store keeps it, read by shards and the gateway; the
    registry that changes it is :mod:`services.generations.registry`.
"""
