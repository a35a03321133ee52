"""Clients of the public gateway API (what the CLI, ``up`` and ``eval --gateway`` use).

``gateway``
    how to reach a running gateway (address, token, TLS) and the calls the tools make.
"""
