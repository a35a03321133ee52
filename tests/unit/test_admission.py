"""Admission's per-client share (services/rpc/admission.py, issue #33 point 1) and who a
client is."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.parking import parked
from services.rpc.admission import Admission, AdmissionRefused, client_key


def test_a_client_is_its_token_when_it_sends_one_else_its_connection() -> None:
    token = [("authorization", "Bearer secret-one")]
    same = [("x-other", "1"), ("authorization", b"Bearer secret-one")]
    other = [("authorization", "Bearer secret-two")]
    assert client_key("ipv4:10.0.0.1:5000", token) == client_key("ipv4:10.0.0.2:6000", same)
    assert client_key("ipv4:10.0.0.1:5000", token) != client_key("ipv4:10.0.0.1:5000", other)
    assert "secret" not in client_key("ipv4:10.0.0.1:5000", token)
    assert client_key("ipv4:10.0.0.1:5000", None) == "peer:ipv4:10.0.0.1:5000"
    assert client_key("ipv4:10.0.0.1:5000", []) != client_key("ipv4:10.0.0.1:5001", [])


def test_past_the_high_water_mark_a_client_over_its_share_is_refused_and_another_admitted() -> None:
    admission = Admission(limit=8, high_water=0.75, client_share=0.5)  # high water 6, share 4
    with contextlib.ExitStack() as held:
        for _ in range(6):  # below the high-water mark a lone client may take more than 4
            held.enter_context(admission.admit(client="a"))
        with pytest.raises(AdmissionRefused, match="this client holds 6 of the 8"):
            held.enter_context(admission.admit(client="a"))
        assert admission.refused_share == 1
        held.enter_context(admission.admit(client="b"))  # its first call
        held.enter_context(admission.admit(client="b"))  # 2 of its share of 4
        assert admission.in_flight == 8
        with pytest.raises(AdmissionRefused, match="limit 8"):
            held.enter_context(admission.admit(client="c"))  # the limit is the limit
    assert admission.in_flight == 0 and admission.by_client == {}


def test_a_first_call_that_costs_more_than_the_share_is_admitted_alone() -> None:
    admission = Admission(limit=32, cost=lambda request: int(request), client_share=0.5)
    with admission.admit(40, client="a"):  # a k=1000 search: the whole limit
        assert admission.in_flight == 32
    with admission.admit(24, client="a"), pytest.raises(AdmissionRefused):
        with admission.admit(1, client="a"):  # holds 24 > its share of 16, past high water
            pass


@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 12), st.booleans()),
        min_size=1,
        max_size=60,
    )
)
def test_the_counts_stay_true_whatever_is_admitted_refused_or_released(
    steps: list[tuple[str, int, bool]],
) -> None:
    """Admit and release in any order: in_flight is the sum of what is held, each client's
    count is its own sum, never over the limit (a call over it alone excepted)."""
    admission = Admission(limit=16, cost=lambda request: int(request), client_share=0.5)
    open_calls: list[tuple[str, int, contextlib.ExitStack]] = []
    for client, cost, release in steps:
        if release and open_calls:
            _, _, stack = open_calls.pop(0)
            stack.close()
        else:
            stack = contextlib.ExitStack()
            try:
                stack.enter_context(admission.admit(cost, client=client))
                open_calls.append((client, min(cost, 16), stack))
            except AdmissionRefused:
                pass
        assert admission.in_flight == sum(units for _, units, _ in open_calls)
        for name in "abc":
            held = sum(units for c, units, _ in open_calls if c == name)
            assert admission.by_client.get(name, 0) == held
        assert admission.in_flight <= 16
    for _, _, stack in open_calls:
        stack.close()
    assert admission.in_flight == 0 and admission.by_client == {}


def test_only_a_share_below_the_limit_needs_the_client_named() -> None:
    assert Admission(limit=8, client_share=0.5).shares
    assert not Admission(limit=8, client_share=1.0).shares  # internal servers
    assert not Admission(limit=0, client_share=0.5).shares  # no limit


def test_a_call_waiting_without_work_lends_its_units_back_and_takes_them_again() -> None:
    """A write paused at a closed writer gate (issue #33: a switch's paused writes held 24
    of 32 units and every search was refused): while it is parked, another client's and
    its own client's calls are admitted; once it goes on it holds its units again, even
    past the limit (it was admitted), and nothing leaks."""
    admission = Admission(limit=8, high_water=1.0, client_share=0.5)  # share 4
    with contextlib.ExitStack() as writes:  # without parking: the limit is reached
        for _ in range(8):
            writes.enter_context(admission.admit(client="writer"))
        with pytest.raises(AdmissionRefused, match="limit 8"):
            with admission.admit(client="reader"):
                pass
    admission = Admission(limit=8, high_water=0.75, client_share=0.5)
    with contextlib.ExitStack() as calls:
        parks = contextlib.ExitStack()
        for _ in range(8):
            calls.enter_context(admission.admit(client="writer"))
            parks.enter_context(parked())  # the innermost admitted call parks
        assert (admission.in_flight, admission.parked_units) == (0, 8)
        with admission.admit(client="reader"), admission.admit(client="reader"):
            assert admission.in_flight == 2
        with admission.admit(client="writer"):  # its own next search is not over its share
            pass
        with admission.admit(client="reader"):
            parks.close()  # the writes go on: their units back, past the limit
            assert admission.in_flight == 9 and admission.parked_units == 0
    assert admission.in_flight == 0 and admission.by_client == {}


def test_past_a_limits_worth_of_parked_units_a_waiting_call_keeps_its_place() -> None:
    admission = Admission(limit=4, high_water=1.0, client_share=1.0)
    with contextlib.ExitStack() as calls:
        for _ in range(4):
            calls.enter_context(admission.admit(client="w"))
            calls.enter_context(parked())
        assert (admission.in_flight, admission.parked_units) == (0, 4)
        calls.enter_context(admission.admit(client="w"))
        calls.enter_context(parked())  # a fifth: no room to park, it counts
        assert (admission.in_flight, admission.parked_units) == (1, 4)
    assert (admission.in_flight, admission.parked_units) == (0, 0)


def test_parked_outside_an_admitted_call_does_nothing() -> None:
    admission = Admission(limit=4)
    with parked():
        assert admission.in_flight == 0 and admission.parked_units == 0


def test_a_wait_inside_a_wait_lends_the_units_once() -> None:
    admission = Admission(limit=4)
    with admission.admit(client="w"), parked():
        with parked():
            assert (admission.in_flight, admission.parked_units) == (0, 1)
        assert (admission.in_flight, admission.parked_units) == (0, 1)
    assert (admission.in_flight, admission.parked_units) == (0, 0)
