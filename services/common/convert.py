"""Protobuf ↔ :mod:`services.common.domain` for the messages of ``common.proto``: the one
mapping of consistency levels, filters and write tokens, used by the gateway's public
API and by the index's internal one (round-trip tested)."""

from __future__ import annotations

from collections.abc import Sequence

from retrieval.v1 import common_pb2
from services.common import positions
from services.common.domain import Consistency, FieldCondition, WriteToken
from services.common.errors import InvalidArgument

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


def token_to_pb(token: WriteToken) -> common_pb2.WriteToken:
    return common_pb2.WriteToken(
        positions=[common_pb2.ShardPosition(shard=s, position=p) for s, p in sorted(token.items())]
    )
