"""The words every layer shares: domain types and the tables that define the service.

No I/O and no grpc here (RPC plumbing is :mod:`services.rpc`, a process's host plumbing
:mod:`services.process`); every other package may import these.

``domain``
    one type per concept the gateway, the router and the reranker share (``Hit``,
    ``Document``, ``WriteToken``, …).
``errors``
    the one error vocabulary (``InvalidArgument``, ``NotFound``, ``Overloaded``, …);
    :mod:`services.rpc.status` maps it to gRPC codes.
``limits``
    every request limit, in one place (also written in the protos).
``positions``
    change-log positions (Redis Stream ids) as a typed, ordered value, and write tokens.
``deadline``
    a request's deadline as an absolute monotonic time.
``timeouts``
    ``wait_for`` that never loses a cancellation (Python 3.11's can).
``fusion``
    hybrid fusion of a dense and a sparse list (reciprocal rank or normalised weights).
``retrieval_setting``
    a generation's retrieval setting (fusion, candidates, reranker checkpoint, depth and
    weight), recorded with it; its JSON file and checks.
``slo``
    the latency SLO table per encoder size.
``encoder_spec``
    which encoder made a generation's vectors.
``parking``
    a call's wait that does no work, said to the layer that admitted it (a write paused
    at a closed writer gate lends its admission units back).
``terms``
    the distinct terms of a sparse query as the shards' text analyser counts them (so
    the gateway checks ``max_query_terms`` before encoding, without tantivy).
"""
