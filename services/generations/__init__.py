"""The rollout builder of index generations (issue #24; the design: docs/generations.md).

:mod:`.append` is the idempotent append into a target generation's logs, :mod:`.builder`
the phase machine (lock, create, P0, train, bulk, catch-up, switch) with its resume,
:mod:`.progress` the progress bar and metrics of ``gtr-retrieval index rollout``.
"""
