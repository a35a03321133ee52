"""The tools' use of the SDK (``gtr_client``, clients/python): what the CLI, ``up`` and
``eval --gateway`` call the public gateway API with.

``gateway``
    how to reach a running gateway (address, token, TLS: flags, environment, the local
    stack's ``stack.json``) and what the tools do with an SDK client (ingest a corpus
    file, one search, its table).
"""
