"""``gtr-retrieval eval``: retrieval quality of the service's pieces on a BEIR folder.

- :mod:`.measures`: nDCG@10, Recall@100, MRR@10 by ``ir-measures`` (pytrec_eval), and the
  paired comparison of two systems on the same queries (scipy);
- :mod:`.entropy`: the contrastive entropy of Fang et al. (SIGIR 2024), a model-quality figure;
- :mod:`.embeddings`: corpus and query embeddings, cached by model and content;
- :mod:`.inprocess`: exact search, IVF-PQ (the shard's own code) at the default and other
  nprobe, and IVF-PQ + rerank, with no servers;
- :mod:`.rerank`: the one rerank loop (a first-stage run reordered by a CELI checkpoint,
  by its score and by each of its terms), used here and by ``gtr-retrieval rerank eval``;
- :mod:`.service`: the same through a running gateway;
- :mod:`.report`: the table and the JSON line; the command is
  :mod:`services.cli.eval_commands`.
"""
