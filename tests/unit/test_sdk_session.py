"""A session's write tokens folded into one (gtr_client/session.py), checked against the
gateway's own reading of a token (services/generations/tokens.py resolve_token): the
folded token makes a SESSION search wait for every write of the session, whatever order
the writes were acknowledged in and across switches of the serving generation."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from gtr_client import Consistency, Query, WriteToken
from gtr_client.session import SessionTokens, newest_positions, position_key
from services.common.domain import TokenOrigin
from services.generations.tokens import resolve_token


@dataclass(frozen=True)
class History:
    """A store's alias history: epoch e (1-based) served by generation ``names[e - 1]``,
    each generation's logs at its switch-in, and the session's writes (epoch, shard,
    position in that epoch's generation's logs), acknowledged in some order."""

    names: tuple[str, ...]
    switch_in: tuple[dict[int, str], ...]
    writes: tuple[tuple[int, int, str], ...]


def _position(n: int) -> str:
    return f"{1000 + n}-{n % 3}"


@st.composite
def histories(draw: st.DrawFn) -> History:
    epochs = draw(st.integers(1, 4))
    names = tuple(draw(st.sampled_from(["g1", "g2", "g3"])) for _ in range(epochs))
    switch_in = tuple(
        {s: _position(draw(st.integers(0, 50))) for s in range(3)} for _ in range(epochs)
    )
    writes = tuple(
        (e, draw(st.integers(0, 2)), _position(draw(st.integers(0, 100))))
        for e in draw(st.lists(st.integers(1, epochs), min_size=1, max_size=8))
    )
    return History(names, switch_in, writes)


def _token(h: History, write: tuple[int, int, str]) -> WriteToken:
    epoch, shard, position = write
    return WriteToken({shard: position}, h.names[epoch - 1], epoch)


def _folded(h: History, order: list[int]) -> WriteToken:
    tokens = SessionTokens()
    for i in order:
        tokens.observe(_token(h, h.writes[i]))
    token = tokens.token()
    assert token is not None
    return token


def _waits_for(h: History, token: WriteToken) -> dict[int, str]:
    """What the gateway makes each shard wait for, the last epoch serving."""
    serving = len(h.names)
    return resolve_token(
        dict(token.positions),
        TokenOrigin(token.generation, token.epoch),
        generation=h.names[serving - 1],
        epoch=serving,
        switch_in=h.switch_in[serving - 1],
    )


def _covered(h: History, waits: dict[int, str], write: tuple[int, int, str]) -> bool:
    """A write is visible once its shard applied its position (a write of the serving
    epoch), or the switch-in positions (a write of an older epoch: the switch replayed
    every write acknowledged before it into the serving generation's logs)."""
    epoch, shard, position = write
    serving = len(h.names)
    needed = position if epoch == serving else h.switch_in[serving - 1][shard]
    return shard in waits and position_key(waits[shard]) >= position_key(needed)


@given(histories(), st.randoms())
def test_the_folded_token_covers_every_write_of_the_session_in_any_order(
    h: History, rnd: random.Random
) -> None:
    order = list(range(len(h.writes)))
    token = _folded(h, order)
    rnd.shuffle(order)
    assert _folded(h, order) == token, "the order the writes were acknowledged in"
    waits = _waits_for(h, token)
    for write in h.writes:
        assert _covered(h, waits, write), (write, token, waits)


def test_within_one_epoch_the_token_is_the_newest_position_per_shard() -> None:
    tokens = SessionTokens()
    assert tokens.token() is None
    tokens.observe(WriteToken({0: "5-1", 1: "9-0"}, "g1", 1))
    tokens.observe(WriteToken({0: "5-0", 2: "3-0"}, "g1", 1))
    tokens.observe(WriteToken())  # a delete of nothing from a gateway without generations
    assert tokens.token() == WriteToken({0: "5-1", 1: "9-0", 2: "3-0"}, "g1", 1)
    assert newest_positions({0: "10-0"}, {0: "9-9"}) == {0: "10-0"}  # numbers, not text


def test_across_a_switch_the_token_names_the_newest_generation_and_the_oldest_epoch() -> None:
    tokens = SessionTokens()
    tokens.observe(WriteToken({1: "7-0"}, "g1", 1))
    tokens.observe(WriteToken({0: "2-0"}, "g2", 2))
    assert tokens.token() == WriteToken({0: "2-0"}, "g2", 1)


def test_a_session_reads_its_writes_unless_the_query_names_its_own_freshness() -> None:
    tokens = SessionTokens()
    plain = Query("q")
    assert tokens.apply(plain) is plain  # nothing written: as the client searches
    tokens.observe(WriteToken({0: "1-0"}, "g1", 1))
    session = tokens.apply(plain)
    assert session.consistency is Consistency.SESSION
    assert session.write_token == WriteToken({0: "1-0"}, "g1", 1)
    strong = Query("q", consistency=Consistency.STRONG)
    assert tokens.apply(strong) is strong
    own = Query("q", write_token=WriteToken({0: "0-1"}))
    assert tokens.apply(own) is own
