"""Log positions: Redis Stream entry IDs ("<ms>-<seq>"), compared as (ms, seq)."""

from __future__ import annotations

from services.common.errors import InvalidArgument

ZERO = "0-0"


def parse(position: str) -> tuple[int, int]:
    """ "1700000000000-3" → (1700000000000, 3); InvalidArgument when malformed."""
    ms, sep, seq = position.partition("-")
    if not ms.isdigit() or (sep and not seq.isdigit()):
        raise InvalidArgument(f"log position {position!r} is not '<ms>-<seq>'")
    return int(ms), int(seq or 0)


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


# A write token: for every shard a write touched, the stream ID of its log entry.
WriteToken = dict[int, str]


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
