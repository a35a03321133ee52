"""Text → token-id batches, shared by the in-process encoder and the Triton models.

This module is copied verbatim next to the Triton Python-backend models (see
``repository.py``), so it depends on numpy and ``tokenizers`` only: the embeddings
served by Triton and the ones computed in-process come from the same code path,
which is what makes them comparable to 1e-4.

Truncation is per input kind (queries 64 tokens, documents 256/512), counts the
special tokens, and is reported per row: a caller must be able to tell that the
end of a long document was not embedded.

A batch runs in pieces of rows of about one length (:func:`length_pieces`): on a CPU a
padded token costs as much as a real one, and one long row padded a whole batch of short
ones (the standard library's documents in arrival order ran 2.8-3.4x slower than the
same rows by length, docs/performance.md "Rows of one length").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer


class TextError(ValueError):
    """A text that cannot be embedded (empty, not UTF-8, wrong kind); the message says which."""


@dataclass(frozen=True)
class TokenBatch:
    """A padded batch, ready for the encoder graph (int64 inputs, as the ONNX export)."""

    input_ids: np.ndarray  # int64 (n, seq)
    attention_mask: np.ndarray  # int64 (n, seq), 1 on real tokens
    truncated: np.ndarray  # bool (n,)

    @property
    def lengths(self) -> np.ndarray:
        """Each row's real tokens."""
        return self.attention_mask.sum(axis=1)

    def pieces(
        self, threads: int | None, *, max_rows: int = 0, one_row: bool = False
    ) -> list[list[int]]:
        """The rows in the pieces a graph on ``threads`` ONNX Runtime threads runs them in:
        :func:`length_pieces` with at most ``max_rows`` (0: :data:`PIECE_ROWS`) rows and
        :func:`piece_tokens`; with ``one_row`` (an int8 graph, whose activation scales span
        its batch) one row per piece."""
        if one_row:
            return [[i] for i in range(len(self.truncated))]
        rows = max_rows or PIECE_ROWS
        return length_pieces(self.lengths.tolist(), rows, max_tokens=piece_tokens(threads))

    def take(self, rows: Sequence[int]) -> TokenBatch:
        """These rows, padded to the longest of them only."""
        index = np.asarray(rows, dtype=np.int64)
        seq = max(int(self.lengths[index].max()), 1)
        return TokenBatch(
            self.input_ids[index, :seq], self.attention_mask[index, :seq], self.truncated[index]
        )


# Padding a piece of rows may add at most this share of its real tokens.
PAD_SLACK = 0.1
# Rows per graph run at most: in the Triton model, a stopping server waits for one such
# run at most (it looks for clients that have gone between two).
PIECE_ROWS = 16
# Padded tokens per graph run at most when ONNX Runtime runs it on one thread: a piece's
# activations then stay in the core's cache (SciFact's documents, FP32 MiniLM, one
# thread: 16.2-16.5 docs/s in pieces of <= 512 tokens, 14.6-15.1 without a budget; on two
# threads a budget only cut what the second thread gets: 23.3-23.6 against 27.5-27.9).
ONE_THREAD_PIECE_TOKENS = 512


def piece_tokens(threads: int | None) -> int:
    """The padded tokens a piece may hold for a graph run on ``threads`` intra-op threads
    (0: no limit; None: ONNX Runtime's default, every core)."""
    return ONE_THREAD_PIECE_TOKENS if threads == 1 else 0


def length_pieces(
    lengths: Sequence[int], max_rows: int, slack: float = PAD_SLACK, max_tokens: int = 0
) -> list[list[int]]:
    """The rows (indexes into ``lengths``, tokens per row) grouped to run together: by
    length, each piece at most ``max_rows`` rows, padded (to its longest row) by at most
    ``slack`` of its real tokens, and (``max_tokens``, 0: no limit) at most that many
    padded tokens unless it is one row. A piece of one row is never padded. Measured with
    the FP32 MiniLM document graph on 2 CPUs (docs/performance.md "Rows of one length"):
    the standard library's documents ran 2.8-3.4x faster by length than in arrival order
    in pieces of 16, on two ONNX threads and on one; SciFact's, longer and more alike,
    1.02-1.23x."""
    if max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    pieces: list[list[int]] = []
    piece: list[int] = []
    tokens = 0
    for i in order:
        n = max(int(lengths[i]), 1)
        padded = n * (len(piece) + 1)
        if piece and (
            len(piece) >= max_rows
            or padded > (1 + slack) * (tokens + n)
            or (max_tokens and padded > max_tokens)
        ):
            pieces.append(piece)
            piece, tokens = [], 0
        piece.append(i)
        tokens += n
    if piece:
        pieces.append(piece)
    return pieces


def run_in_pieces(
    batch: TokenBatch, pieces: list[list[int]], run: Callable[[TokenBatch], np.ndarray]
) -> np.ndarray:
    """``run`` (a graph: a batch in, one vector per row out; it may raise to stop) over
    each piece of ``batch``'s rows (:meth:`TokenBatch.pieces`), the vectors put back in the
    batch's order as float32."""
    n = len(batch.truncated)
    if len(pieces) <= 1:  # one piece (or no row): the batch as it is
        return np.asarray(run(batch), dtype=np.float32)
    out: np.ndarray | None = None
    for piece in pieces:
        vectors = run(batch.take(piece))
        if out is None:
            out = np.empty((n, vectors.shape[1]), dtype=np.float32)
        out[piece] = vectors
    assert out is not None
    return out


def check_texts(texts: list[str], max_batch: int | None = None) -> None:
    """Reject what no model can embed, naming the first offending row."""
    if not texts:
        raise TextError("no texts given: send at least one text")
    if max_batch is not None and len(texts) > max_batch:
        raise TextError(f"batch of {len(texts)} texts is over the limit of {max_batch}")
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise TextError(f"text {row} is {type(text).__name__}, not a string")
        if not text.strip():
            raise TextError(f"text {row} is empty or only whitespace")


def decode_utf8(raw: bytes, row: int) -> str:
    """Strict UTF-8 decoding: invalid bytes are an error, not silently replaced."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"{exc.reason} at byte {exc.start}"
        raise TextError(f"text {row} is not valid UTF-8 ({reason})") from None


def parse_rows(
    raw_texts: list[bytes], raw_kinds: list[bytes], kinds: set[str]
) -> tuple[list[str], list[str]]:
    """Decode the BYTES columns of one Triton request; one KIND may serve every row."""
    if not raw_texts:
        raise TextError("no texts given: send at least one text")
    if len(raw_kinds) not in (1, len(raw_texts)):
        raise TextError(f"KIND has {len(raw_kinds)} rows for {len(raw_texts)} texts")
    texts, row_kinds = [], []
    for row, raw in enumerate(raw_texts):
        text = decode_utf8(bytes(raw), row)
        if not text.strip():
            raise TextError(f"text {row} is empty or only whitespace")
        kind = decode_utf8(bytes(raw_kinds[row if len(raw_kinds) > 1 else 0]), row)
        kind = kind.strip().lower()
        if kind not in kinds:
            raise TextError(f"kind {kind!r} of row {row} is unknown: use one of {sorted(kinds)}")
        texts.append(text)
        row_kinds.append(kind)
    return texts, row_kinds


class TextCodec:
    """Tokenizes with one ``tokenizers.Tokenizer`` and a token budget per kind.

    ``seq_buckets`` (GPU flavour) pads every batch up to the next bucket length, so
    that requests of similar length have *identical* shapes and Triton's dynamic
    batcher can merge them in front of a TensorRT engine.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_lens: dict[str, int],
        pad_id: int,
        seq_buckets: tuple[int, ...] = (),
    ) -> None:
        self.max_lens = dict(max_lens)
        self.pad_id = pad_id
        self.seq_buckets = tuple(sorted(seq_buckets))
        self._by_kind: dict[str, Tokenizer] = {}
        for kind, max_len in self.max_lens.items():
            tok = copy.deepcopy(tokenizer)
            tok.no_padding()  # padding is done here, to the longest row of each batch
            tok.enable_truncation(max_length=max_len)
            self._by_kind[kind] = tok

    @classmethod
    def from_file(
        cls, path: str, max_lens: dict[str, int], pad_id: int, seq_buckets: tuple[int, ...] = ()
    ) -> TextCodec:
        return cls(Tokenizer.from_file(path), max_lens, pad_id, seq_buckets)

    def check_kind(self, kind: str) -> str:
        if kind not in self.max_lens:
            raise TextError(f"unknown kind {kind!r}: use one of {sorted(self.max_lens)}")
        return kind

    def encode(self, texts: list[str], kind: str) -> TokenBatch:
        """Tokenize, truncate to the kind's budget, pad to the longest row."""
        return self.encode_mixed(texts, [kind] * len(texts))

    def encode_mixed(self, texts: list[str], kinds: list[str]) -> TokenBatch:
        """Like :meth:`encode` with one kind per row (Triton batches mix requests)."""
        rows: list[list[int]] = [[] for _ in texts]
        truncated = np.zeros(len(texts), dtype=bool)
        for kind in sorted(set(kinds)):
            index = [i for i, k in enumerate(kinds) if k == kind]
            encoded = self._by_kind[self.check_kind(kind)].encode_batch([texts[i] for i in index])
            for i, enc in zip(index, encoded, strict=True):
                rows[i] = enc.ids
                truncated[i] = bool(enc.overflowing)
        longest = max((len(r) for r in rows), default=1)
        seq = next((b for b in self.seq_buckets if b >= longest), longest)
        ids = np.full((len(texts), seq), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(texts), seq), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return TokenBatch(ids, mask, truncated)
