"""``gtr-retrieval eval``: retrieval quality of the service's pieces on a BEIR folder.

- the measures it reports are :mod:`services.measures` (ranking measures, contrastive
  entropy); the cached embeddings it scores are :mod:`services.encoder.embeddings`;
- :mod:`.inprocess`: exact search, IVF-PQ (the shard's own code) at the default and other
  nprobe, and IVF-PQ + rerank, with no servers;
- :mod:`.rerank`: the one rerank loop (a first-stage run reordered by a CELI checkpoint,
  by its score and by each of its terms), used here and by ``gtr-retrieval rerank eval``;
- :mod:`.service`: the same through a running gateway;
- :mod:`.report`: the table and the JSON line; the command is
  :mod:`services.cli.eval_commands`;
- :mod:`.run`: one evaluation from a config to a report (in process or through a gateway);
- :mod:`.config`: what one run evaluates;
- :mod:`.data`: the BEIR folder of one evaluation as arrays (queries, documents, their
  embeddings).
"""
