"""The encoder interface the rest of the service depends on, and its input checks.

Two implementations: :class:`~services.encoder.runtime.triton_client.TritonEncoder` (the
production path, KServe v2 gRPC to Triton) and
:class:`~services.encoder.runtime.inprocess.InProcessEncoder` (the same model in this process,
for the embedded mode and tests). Callers never branch on which one they hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import numpy as np

from services.common.errors import InvalidArgument
from services.encoder.profiles import KINDS, Kind, ModelProfile
from services.encoder.textcodec import TextError, check_texts


@dataclass(frozen=True)
class Embeddings:
    """One row per input text, in input order."""

    vectors: np.ndarray  # float32 (n, dim), L2-normalised
    truncated: list[bool]  # True where the text was cut to the kind's token budget


class Encoder(ABC):
    """Texts → L2-normalised embeddings; async, deadline-aware, closes its resources."""

    model_name: str
    dim: int
    max_batch: int

    @abstractmethod
    async def encode(
        self, texts: Sequence[str], kind: Kind, timeout: float | None = None
    ) -> Embeddings:
        """Embed ``texts`` as queries or documents within ``timeout`` seconds.

        Raises InvalidArgument (bad input), DeadlineExceeded, Unavailable, Overloaded.
        """

    @abstractmethod
    async def close(self) -> None:
        """Release connections / threads; the encoder is unusable afterwards."""

    async def __aenter__(self) -> Encoder:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class Embedder(Protocol):
    """A synchronous model + tokenizer (PyTorch or ONNX Runtime) in this process."""

    backend: str
    model_name: str
    dim: int
    profile: ModelProfile

    def embed(self, texts: list[str], kind: Kind) -> tuple[np.ndarray, list[bool]]: ...


def validate_request(texts: Sequence[str], kind: str, max_batch: int) -> list[str]:
    """Check a request before it costs a round trip; InvalidArgument says what is wrong."""
    if isinstance(texts, str):
        raise InvalidArgument("texts must be a sequence of strings, not one string")
    if kind not in KINDS:
        raise InvalidArgument(f"unknown kind {kind!r}: use one of {list(KINDS)}")
    items = list(texts)
    try:
        check_texts(items, max_batch)
    except TextError as exc:
        raise InvalidArgument(str(exc)) from None
    return items


def version_key(version: int, key: str) -> str:
    """The config parameter ``key`` of one model version: ``version.<n>.<key>``."""
    return f"version.{version}.{key}"


# Triton's dynamic batcher priority levels (1 = served first), written into a generated
# model config when asked (RepositoryConfig.priority_levels, `encoder repo
# --priority-levels 2`; off by default: Triton 24.10's priority queue held a request that
# arrived while the instance ran until the next arrival, ~0.5 s) and sent by
# services/encoder/runtime/triton_client.py. Queries, and every caller that names no
# priority, are level 1; the index builder's bulk document encodes send level 2, so with
# the levels a query waits at most for the batch already running, never behind the
# builder's queued batches (issue #24: search p99 during a rollout). Without them Triton
# ignores the priority a request names.
QUERY_PRIORITY = 1
DOCUMENT_PRIORITY = 2
PRIORITY_LEVELS = 2
