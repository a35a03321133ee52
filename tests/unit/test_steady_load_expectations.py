"""What the generation tests expect a generation to hold (tests/support/steady_load.py
``expected_presence``): the writes of the epochs before it stopped serving, in order, and
nothing promised about a document with a write that was not acknowledged."""

from __future__ import annotations

from tests.support.steady_load import Recorded, WriteOp, expected_presence


def op(doc: str, kind: str, epoch: int, end: float = 1.0, code: str = "OK") -> WriteOp:
    return WriteOp(doc, kind, start=end - 0.1, end=end, code=code, generation="g", epoch=epoch)


def test_the_last_acknowledged_write_of_the_counted_epochs_decides() -> None:
    writes = [
        op("a", "upsert", 1),
        op("a", "delete", 2),  # deleted after the first switch
        op("b", "upsert", 1),
        op("b", "delete", 1),
        op("b", "upsert", 3),  # back in epoch 3
        op("c", "upsert", 2),  # written after the first switch only
    ]
    assert expected_presence(writes) == ({"b", "c"}, {"a"}, set())
    # a generation that stopped serving at epoch 2 holds epoch 1's writes only
    assert expected_presence(writes, before_epoch=2) == ({"a"}, {"b", "c"}, set())
    assert expected_presence(writes, before_epoch=3) == ({"c"}, {"a", "b"}, set())


def test_a_write_not_acknowledged_or_not_yet_done_promises_nothing() -> None:
    writes = [
        op("a", "upsert", 1),
        op("a", "delete", 1, code="UNAVAILABLE"),
        op("b", "upsert", 1, end=5.0),  # ended after the check's cut
        op("c", "upsert", 1, code=""),  # still in flight
        op("d", "upsert", 1, end=2.0),
    ]
    assert expected_presence(writes, acked_before=3.0) == ({"d"}, set(), {"a", "b", "c"})


def test_a_search_may_name_any_generation_the_alias_named_while_it_ran() -> None:
    from tests.support.steady_load import AliasChange

    rec = Recorded(
        aliases=[AliasChange(0.0, "g1", 1), AliasChange(10.0, "g2", 2), AliasChange(20.0, "g1", 3)]
    )
    assert rec.serving_between(1.0, 2.0) == {"g1"}
    assert rec.serving_between(9.0, 11.0) == {"g1", "g2"}
    assert rec.serving_between(12.0, 13.0) == {"g2"}
    assert rec.serving_between(15.0, 25.0) == {"g2", "g1"}
