"""gtr-retrieval: the service's packages, in layers (each imports its own layer or lower
ones only: ``tests/unit/test_import_cycles.py``; docs/architecture.md "Packages").

``common``
    the words every layer shares: domain types, errors, limits, positions, SLOs.
``process``
    host plumbing of a process: logging, Redis clients, CPU sets.
``telemetry``
    OpenTelemetry tracing: configuration, spans, W3C context in and out, exemplars
    (docs/tracing.md).
``rpc``
    gRPC plumbing: server bootstrap, interceptors, status map, auth, TLS, balancing.
``corpus``
    corpora and their judgements (BEIR, JSONL, the embedded stdlib docs).
``measures``
    ranking measures and the contrastive entropy, with nothing above ``common``.
``index``
    sharded FAISS IVF-PQ + BM25 over a Redis change log: the shard core, its replica
    process, the router and writer the gateway uses.
``encoder``
    the GTR dual encoder: model, ONNX/TensorRT artefacts, Triton serving, training.
``rerank``
    the CELI cross-encoder: model, checkpoint, scorer service, training.
``eval``
    ``gtr-retrieval eval``: quality of the pieces, in process or through a gateway.
``client``
    the client of the public gateway API that the tools use.
``generations``
    index generations: registry, rollout builder by phase, lifecycle, drift, CPU budget,
    which encoder versions stay published.
``gateway``
    the public gRPC API: validation, the search pipeline, the document writes.
``tune``
    ``gtr-retrieval tune``: encoder, fusion and reranker trained and chosen together.
``plan``
    ``gtr-retrieval plan``: capacity from measured figures.
``stack``
    ``gtr-retrieval up``: the local stack's processes and their supervision.
``cli``
    the command line: registers commands, translates flags into calls.
"""
