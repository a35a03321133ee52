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
