"""Log positions: Redis Stream entry IDs ("<ms>-<seq>"), compared as (ms, seq).

On the wire and in Redis a position is its string; inside a process that compares it
more than once (a shard's SESSION search: the applied position, the log end, each waiter)
it is a :class:`Position`, parsed once where it comes in (issue #32). The string helpers
below (:func:`at_least`, :func:`newest`, :func:`compare`, …) stay for the code that
compares a position once or keeps the strings (the write tokens, the rollout): each call
parses its arguments again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.common.domain import WriteToken
from services.common.errors import InvalidArgument

__all__ = [
    "ZERO",
    "Position",
    "WriteToken",
    "at_least",
    "compare",
    "covers",
    "merge_tokens",
    "parse",
]

ZERO = "0-0"

# A Redis Stream ID: two unsigned 64-bit integers in ASCII decimal, "<ms>-<seq>", both
# parts required, as common.proto's ShardPosition states. Redis itself accepts "<ms>" for
# "<ms>-0" in XRANGE, but every position this service hands out (XADD's reply, a
# snapshot's, "0-0") is complete, so a bare "<ms>" in a write token is a client's mistake
# (a timestamp, a count), refused rather than guessed. ``str.isdigit`` is not enough: it
# accepts "²" and other Unicode digits that ``int`` refuses, and it bounds nothing.
_POSITION = re.compile(r"([0-9]{1,20})-([0-9]{1,20})", re.ASCII)
_U64_MAX = (1 << 64) - 1
MAX_POSITION_CHARS = 41


def parse(position: str) -> tuple[int, int]:
    """ "1700000000000-3" → (1700000000000, 3); InvalidArgument when malformed."""
    match = _POSITION.fullmatch(position)
    if match is None:
        shown = position if len(position) <= MAX_POSITION_CHARS else position[:20] + "…"
        raise InvalidArgument(f"log position {shown!r} is not '<ms>-<seq>' (ASCII digits)")
    ms, seq = int(match[1]), int(match[2])
    if ms > _U64_MAX or seq > _U64_MAX:
        raise InvalidArgument(f"log position {position!r}: a part exceeds 2^64-1")
    return ms, seq


@dataclass(frozen=True, order=True, slots=True)
class Position:
    """A parsed stream ID; ordered as the stream orders its entries (``ms``, then ``seq``).

    ``str(Position.parse(x)) == x`` for every valid ``x`` (digits without leading zeros,
    as Redis writes them), so a position goes back on the wire unchanged.
    """

    ms: int
    seq: int

    @classmethod
    def parse(cls, position: str) -> Position:
        """InvalidArgument when ``position`` is not ``"<ms>-<seq>"`` (see :func:`parse`)."""
        return cls(*parse(position))

    @classmethod
    def of(cls, position: Position | str) -> Position:
        """``position`` itself, or parsed: for callers that may hold either."""
        return position if isinstance(position, Position) else cls.parse(position)

    def __str__(self) -> str:
        return f"{self.ms}-{self.seq}"


ZERO_POSITION = Position(0, 0)


def at_least(applied: str, wanted: str) -> bool:
    return parse(applied) >= parse(wanted)


def newest(*positions: str) -> str:
    return max(positions, key=parse)


def oldest(*positions: str) -> str:
    return min(positions, key=parse)


def ms_of(position: str) -> int:
    return parse(position)[0]


def compare(a: str, b: str) -> int:
    """-1, 0 or 1 as stream ID ``a`` is before, equal to or after ``b``."""
    pa, pb = parse(a), parse(b)
    return (pa > pb) - (pa < pb)


def merge_tokens(*tokens: WriteToken) -> WriteToken:
    """The token covering all of ``tokens``: the newest position per shard."""
    merged: WriteToken = {}
    for token in tokens:
        for shard, position in token.items():
            merged[shard] = newest(merged[shard], position) if shard in merged else position
    return merged


def covers(applied: WriteToken, token: WriteToken) -> bool:
    """True when every shard in ``applied`` has reached its position in ``token``."""
    return all(
        shard in applied and at_least(applied[shard], position) for shard, position in token.items()
    )
