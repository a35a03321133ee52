"""Protobuf ↔ :mod:`services.common.domain` for the messages of ``common.proto``: the one
mapping of consistency levels, filters and write tokens (their positions, and the
generation and alias epoch they were taken in), used by the gateway's public API and by
the index's internal one (round-trip tested)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from retrieval.v1 import common_pb2
from services.common import positions
from services.common.domain import Consistency, FieldCondition, TokenOrigin, WriteToken
from services.common.errors import InvalidArgument

# A generation's name: "g" and its number (services.generations.registry.generation_number).
_GENERATION = re.compile(r"g[1-9][0-9]{0,8}")

_CONSISTENCY = {
    common_pb2.CONSISTENCY_UNSPECIFIED: Consistency.EVENTUAL,
    common_pb2.CONSISTENCY_EVENTUAL: Consistency.EVENTUAL,
    common_pb2.CONSISTENCY_SESSION: Consistency.SESSION,
    common_pb2.CONSISTENCY_STRONG: Consistency.STRONG,
}
_CONSISTENCY_PB = {v: k for k, v in _CONSISTENCY.items() if k != common_pb2.CONSISTENCY_UNSPECIFIED}


def consistency_from_pb(value: int) -> Consistency:
    if value not in _CONSISTENCY:
        raise InvalidArgument(f"consistency: unknown value {value}")
    return _CONSISTENCY[value]  # type: ignore[index]


def consistency_to_pb(value: Consistency) -> common_pb2.Consistency.ValueType:
    return _CONSISTENCY_PB[value]


def filter_from_pb(f: common_pb2.Filter) -> tuple[FieldCondition, ...]:
    return tuple(FieldCondition(c.key, tuple(c.any_of)) for c in f.must)


def filter_to_pb(conditions: Sequence[tuple[str, Sequence[str]]]) -> common_pb2.Filter:
    return common_pb2.Filter(
        must=[common_pb2.FieldCondition(key=k, any_of=v) for k, v in conditions]
    )


def token_from_pb(token: common_pb2.WriteToken) -> WriteToken:
    """The token's positions by shard; InvalidArgument for a shard given twice or a
    position that is not a log position ("ms-seq", ASCII digits)."""

    out: WriteToken = {}
    for pos in token.positions:
        if pos.shard in out:
            raise InvalidArgument(f"write_token: shard {pos.shard} appears twice")
        out[pos.shard] = pos.position
    for shard, position in out.items():
        try:
            positions.parse(position)
        except InvalidArgument as exc:
            raise InvalidArgument(f"write_token: shard {shard}: {exc.message}") from None
    return out


def token_origin_from_pb(token: common_pb2.WriteToken) -> TokenOrigin:
    """The generation and alias epoch a token was taken in (TokenOrigin() when it names
    none); InvalidArgument for a generation that is not a generation's name, or for one
    of the two without the other."""
    if token.generation and not _GENERATION.fullmatch(token.generation):
        raise InvalidArgument(
            f"write_token: generation {token.generation[:40]!r} is not a generation's name "
            "(g1, g2, ...)"
        )
    if bool(token.generation) != bool(token.epoch):
        raise InvalidArgument(
            "write_token: generation and epoch come together (pass the token as the write "
            "returned it)"
        )
    return TokenOrigin(token.generation, token.epoch)


def token_to_pb(token: WriteToken, origin: TokenOrigin | None = None) -> common_pb2.WriteToken:
    out = common_pb2.WriteToken(
        positions=[common_pb2.ShardPosition(shard=s, position=p) for s, p in sorted(token.items())]
    )
    if origin is not None:
        out.generation = origin.generation
        out.epoch = origin.epoch
    return out
