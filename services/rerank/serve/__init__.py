"""The reranker process.

``scorer``
    the core: (query, candidates) → scores and ranked hits, no grpc.
``convert``
    proto ↔ domain of ``RerankService`` (the only place both meet).
``pool``
    the default model and the checkpoints of ``--checkpoint-dir`` by name (lazy, LRU).
``servicer``
    ``RerankService``: proto → domain → scorer (in a worker thread) → proto.
``metrics``
    the reranker's metrics on an injected registry.
``settings``
    its configuration (``GTR_RERANK_<FIELD>`` or ``--<field>``).
``server``
    the process: load the checkpoint, serve.
"""
