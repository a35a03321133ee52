"""The optional CELI reranker: the model, its checkpoint, its serving and its training.

``model``
    CELI (a linear head on [CLS] + MaxSim late interaction) on any HF encoder backbone.
``checkpoint``
    the checkpoint directory the trainer writes and the service reads.
``depths``
    the rerank depth a latency budget allows, from the table ``bench/rerank.py`` measures.
``domain``
    the reranker's request and answer (no proto, no grpc).
``tiny``
    a tiny random backbone and vocabulary for tests and smoke runs.
``serve/``
    the reranker process: the scorer core and its gRPC service.
``train/``
    training with localized contrastive estimation over a first stage's candidates.
"""
