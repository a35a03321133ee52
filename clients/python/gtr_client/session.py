"""Read-your-writes without bookkeeping: the write tokens a session has been given, folded
into the one token its searches send.

Within one alias epoch (no switch of the serving index generation in between) the token
is every write's positions, the newest per shard: a SESSION search waits until each
shard has applied them. Across a switch (docs/generations.md) the gateway reads a token
of an older epoch as the serving generation's positions at its switch (every write
acknowledged before the switch is in them), merged with the token's own positions when
they are in the serving generation's logs. So a session whose writes span epochs sends
the newest epoch's generation and positions with the *oldest* epoch it wrote in: the
older writes are covered by the switch, the newer ones by their positions. Positions of
older epochs are never needed (a switch came after them), which also makes the folded
token the same whatever order concurrent writes were acknowledged in.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from gtr_client.types import Consistency, Query, WriteToken


def position_key(position: str) -> tuple[int, int]:
    """A log position ``"ms-seq"`` as numbers, to compare two of them."""
    ms, _, seq = position.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        raise ValueError(f"write token position {position!r} is not 'ms-seq'") from None


def newest_positions(*tokens: dict[int, str] | WriteToken) -> dict[int, str]:
    """Per shard, the newest position of any of ``tokens``."""
    out: dict[int, str] = {}
    for token in tokens:
        positions = token.positions if isinstance(token, WriteToken) else token
        for shard, position in positions.items():
            if shard not in out or position_key(position) > position_key(out[shard]):
                out[shard] = position
    return out


class SessionTokens:
    """The writes of one session (thread-safe): :meth:`observe` each write's token,
    :meth:`token` is what a search sends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._newest_epoch: int | None = None
        self._oldest_epoch = 0
        self._generation = ""
        self._positions: dict[int, str] = {}

    def observe(self, token: WriteToken) -> None:
        """Fold in the token of an acknowledged write (one with no positions and no epoch,
        a delete of ids that did not exist from a gateway without generations, changes
        nothing)."""
        if not token:
            return
        with self._lock:
            if self._newest_epoch is None:
                self._newest_epoch = self._oldest_epoch = token.epoch
                self._generation = token.generation
                self._positions = dict(token.positions)
                return
            self._oldest_epoch = min(self._oldest_epoch, token.epoch)
            if token.epoch > self._newest_epoch:
                self._newest_epoch = token.epoch
                self._generation = token.generation
                self._positions = dict(token.positions)
            elif token.epoch == self._newest_epoch:
                self._positions = newest_positions(self._positions, token)

    def token(self) -> WriteToken | None:
        """The token a SESSION search sends (None: nothing written yet)."""
        with self._lock:
            if self._newest_epoch is None:
                return None
            return WriteToken(dict(self._positions), self._generation, self._oldest_epoch)

    def apply(self, query: Query) -> Query:
        """``query`` as the session sends it: a query that names neither a consistency
        nor a token reads the session's writes (SESSION with its token) once it has
        written; anything the query names is kept."""
        if query.consistency is not None or query.write_token is not None:
            return query
        token = self.token()
        if token is None:
            return query
        return replace(query, consistency=Consistency.SESSION, write_token=token)
