"""Clients of the public gateway API (what the CLI, ``up`` and ``eval --gateway`` use)."""
