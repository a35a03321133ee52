"""A parsed log position (:class:`services.common.positions.Position`) orders as the Redis
stream orders its IDs and prints back the string it was parsed from, so comparing parsed
values inside a shard means what comparing the strings meant (issue #32)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common import positions
from services.common.errors import InvalidArgument
from services.common.positions import ZERO, ZERO_POSITION, Position

U64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
# small values too, so equal ms (ordering by seq) and equal ids come up often
PART = st.one_of(st.integers(min_value=0, max_value=3), U64)
IDS = st.builds(lambda ms, seq: f"{ms}-{seq}", PART, PART)


@given(IDS)
def test_a_position_prints_the_id_it_was_parsed_from(text: str) -> None:
    assert str(Position.parse(text)) == text


@given(IDS, IDS)
def test_positions_order_as_the_stream_orders_ids(a: str, b: str) -> None:
    pa, pb = Position.parse(a), Position.parse(b)
    ms_a, seq_a = (int(x) for x in a.split("-"))
    ms_b, seq_b = (int(x) for x in b.split("-"))
    # the stream's order: by milliseconds, then by sequence number, as integers
    assert (pa < pb) == ((ms_a, seq_a) < (ms_b, seq_b))
    assert (pa == pb) == (a == b)
    # and the string helpers the rest of the code keeps agree
    assert positions.compare(a, b) == (pa > pb) - (pa < pb)
    assert positions.at_least(a, b) == (pa >= pb)
    assert Position.parse(positions.newest(a, b)) == max(pa, pb)


def test_numbers_not_text_decide() -> None:
    assert Position.parse("9-0") < Position.parse("10-0")  # as text "10-0" < "9-0"
    assert Position.parse("1-9") < Position.parse("1-10")
    assert Position.parse(ZERO) == ZERO_POSITION
    assert str(ZERO_POSITION) == ZERO


def test_of_keeps_a_position_and_parses_a_string() -> None:
    p = Position(5, 1)
    assert Position.of(p) is p
    assert Position.of("5-1") == p


@pytest.mark.parametrize("bad", ["", "5", "5-", "-1", "a-b", "²-1", "1-2-3", f"{1 << 64}-0"])
def test_a_malformed_position_is_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        Position.parse(bad)


def test_a_position_does_not_compare_with_its_string() -> None:
    """A string left unparsed somewhere fails loudly instead of ordering as text."""
    with pytest.raises(TypeError):
        assert Position(1, 0) < "2-0"  # type: ignore[operator]
    assert Position(1, 0) != "1-0"
