"""Corpora: the documents a stack ingests and the judgements it is measured with.

``beir``
    BEIR datasets (corpus, queries, qrels): read, and split by query.
``readers``
    a corpus file (BEIR ``corpus.jsonl`` or plain JSONL) into documents.
``runs``
    ranked-list files ``{query id: [doc id, ...]}`` the trainers mine negatives from.
``stdlib``
    the embedded default corpus: the Python standard library's documentation.
"""
