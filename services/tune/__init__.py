"""``gtr-retrieval tune``: the whole quality recipe on a user's BEIR data, measured together.

One command trains the encoder variant(s) asked for, picks each encoder's fusion on a
validation split, trains the CELI reranker on the first stage it will serve behind, picks
the rerank depth (within the deployment's latency budget) and the interpolation weight,
and writes one report: every system side by side on the dev split with paired intervals
against what serves now. The pieces: :mod:`.config` (the request), :mod:`.splits`
(train / validation / dev), :mod:`.lists` (each encoder's first-stage lists, in process
with the shard's own index code), :mod:`.choice` (fusion and rerank settings),
:mod:`.rerankers` (training and scoring), :mod:`.report` and :mod:`.pipeline` (the
resumable stages), ``table`` (the report as text), :mod:`.rollout` (the best system's
retrieval setting as ``index rollout --retrieval-setting`` takes it). The design and the
measured result: docs/tune.md.
"""
