"""Training the dual encoder (``gtr-retrieval encoder train``) and evaluating what it made.

Package map:

- ``trainer``: one run in named steps (set up, resume, steps, finish); its public API.
- ``config``: ``TrainConfig``, the recipe of a run.
- ``steps``: one step: the batches, the in-batch loss, GradCache, the optimiser.
- ``progress``: what a run records: the dev pool's nDCG, trainer state, manifest, plot.
- ``data``: the split, the pairs, hard negatives mined once.
- ``towers``: the five dual-encoder architectures built from one checkpoint.
- ``manifest``: a checkpoint's ``manifest.json``.
- ``evaluate``: dev-split quality of trained encoders, as served (``eval --encoder``).
"""
