"""Which encoder made a generation's vectors (issue #24, docs/generations.md).

It sits in ``common`` because both sides of the generation record need it: the index's
shards read it from their generation's record (:mod:`services.index.records`) and the
encoder's repository returns it for a version it publishes
(:mod:`services.encoder.serve.publish`); neither may import the other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EncoderSpec:
    """Which encoder a generation's vectors come from: Triton's model and version, its
    width, and the digest of the weights (the query cache and the rollout compare
    generations by it). Version 0 = recorded without one (before any ``encoder publish``,
    e.g. by a shard from its manifest): the repository's first version, 1. Never "the
    newest": after a publish that is another encoder (docs/generations.md)."""

    model: str
    version: int = 0
    dim: int = 0
    digest: str = ""
    source: str = ""  # the checkpoint folder it was exported from, for the record

    def identity(self) -> str:
        """What decides a document's vector: the model, the version (0 read as 1, as
        above), the width and the weights' digest; the checkpoint folder only when there
        is no digest (an in-process encoder has no version nor digest, only its folder).
        With a digest the folder is only the record of where it was exported from: the
        same weights published from another folder are served by the same Triton
        version, and counting the folder made a rollout to them encode every document
        and every write again on the serving version (``bench.rollout`` on a reused run
        dir). Two generations whose identities are equal give every text the same
        vector: a rollout between them reuses the change log's vectors instead of
        encoding again, and a vector the gateway logged for a rollout's target names the
        target's encoder by it (docs/generations.md, "Catch-up under writes")."""
        where = self.digest if self.digest else f"|{self.source}"
        return f"{self.model}@{self.version or 1}/{self.dim}#{where}"
