"""Quality measures with no dependency above ``services.common``, so the encoder's training
loop, the rerank evaluation and ``gtr-retrieval eval`` share them without importing each
other (issue #32: they lived in ``services.eval``, which imports the encoder, closing a cycle).

- :mod:`.ranking`: nDCG@10, Recall@100, MRR@10 by ``ir-measures`` (pytrec_eval), and the
  paired comparison of two systems on the same queries (scipy);
- :mod:`.entropy`: the contrastive entropy of Fang et al. (SIGIR 2024), a model-quality figure.
"""
