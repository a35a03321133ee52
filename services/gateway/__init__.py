"""The gateway: the public API in front of the encoder, the index shards and the reranker.

Package map:

- ``server``: the process; wires encoder, shard router, document store and reranker.
- ``settings``: its configuration (env vars ``GTR_GATEWAY_<FIELD>`` or flags).
- ``encoders``: the encoder of a generation (Triton, queries here when it can; in process).
- ``servicer``: the public gRPC servicers (proto → domain → pipeline → proto).
- ``http_port``: the HTTP/JSON port (``--http-port``): the same servicers transcoded.
- ``convert``: protobuf ↔ domain conversions.
- ``domain``: the requests and results the pipelines work with, free of protobuf.
- ``validation``: public request checks, with messages that name the field and rule.
- ``pipeline``: the search core, running a query through the stages below.
- ``budget``: the time each search stage gets, and the bounded wait.
- ``embedding``: the query embeddings (encoder call, query-embedding cache).
- ``first_stage``: dense, sparse or hybrid (fused) first stage; the index calls.
- ``reranking``: the rerank depth for the time left, and the reranked answer.
- ``document_pipeline``: the writes (encode → log) and reads of documents.
- ``write_trail``: where a slow or unanswered write's time went, logged as one warning.
- ``texts``: what of a document the encoder gets.
- ``query_cache``: query embeddings kept in Redis.
- ``generations``: which index generation answers a request.
- ``generation_parts``: a generation's parts (encoder, shards, documents, logs) and
  the alias as the gateway holds them.
- ``latency_report``: the searches' latency, written to Redis every second (a rollout
  paces itself on it).
- ``dual_write``: during a rollout to another encoder, upserts encoded for its target too.
- ``ports``: the protocols the pipelines reach the other stages through.
- ``rerank_client``: the client of the internal RerankService.
- ``metrics``: gateway metrics.
"""
