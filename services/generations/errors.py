"""The domain errors of generations that a caller may want to word its own way.

They are ordinary :class:`~services.common.errors.FailedPrecondition` errors (the same
status and message everywhere); the CLI catches these to add which of its flags supplies
what is missing (``services/cli/generation_places.py``), which the package does not know.
"""

from __future__ import annotations

from services.common.errors import FailedPrecondition, InvalidArgument


class SourceAddressesUnknown(FailedPrecondition):
    """A retrain needs the source generation's replicas, and their addresses are unknown."""


class NoModelRepository(FailedPrecondition):
    """A new encoder must be published, and no Triton model repository was given."""


class TransportMismatch(FailedPrecondition):
    """A shard replica speaks TLS and the builder plaintext (``replica_tls``), or the other
    way round."""

    def __init__(self, message: str, *, replica_tls: bool) -> None:
        super().__init__(message)
        self.replica_tls = replica_tls


class PlanRefused(InvalidArgument):
    """A rollout's plan refused for one of its options: ``option`` is ``retrain``,
    ``shards`` or ``encoder``, and the message says what is wrong with it, worded to
    follow the option's name (the CLI puts its flag first)."""

    def __init__(self, message: str, *, option: str) -> None:
        super().__init__(message)
        self.option = option


class HeldEntriesExceeded(FailedPrecondition):
    """A rollout held more of its source's log entries than ``--max-held-entries``: it
    was aborted (services/generations/held.py)."""
