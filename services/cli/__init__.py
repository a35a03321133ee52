"""``gtr-retrieval``, the one command-line entry point (``main``), and its command groups.

Package map:

- ``main``: the entry point; registers every group below.
- ``common``: what the sub-commands share (argument types, the handler wrapper).
- ``serve``: one way for every service to declare its ``serve`` command.
- ``encoder_commands``: ``encoder export|parity|repo|build-plan|ensure-plan|embed|perf-input``.
- ``encoder_version_commands``: ``encoder publish|unpublish|versions``.
- ``encoder_train_commands``: ``encoder train`` and ``eval --encoder``.
- ``index_commands``, ``generation_commands``, ``drift_commands``: ``index …``
  (``generation_commands`` declares ``index rollout|rollback|retire|generations``,
  ``generation_handlers`` turns their flags into calls of :mod:`services.generations`
  and the results into words, ``generation_places`` finds the store, Triton and the
  replicas and words domain errors in flags).
- ``gateway_commands``, ``rerank_commands``, ``redis_commands``, ``corpus_commands``,
  ``eval_commands``, ``plan_commands``, ``stack_commands``, ``client_commands``: the
  other groups, one module each.
- ``tune_commands``: ``tune``, the whole quality recipe on a BEIR folder (docs/tune.md).
"""
