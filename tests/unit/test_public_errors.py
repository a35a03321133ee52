"""services.rpc.status.public_message: what the public gateway tells a client of an
inner hop's error names no internal address (issue #33 point 5); the rest of the text,
which shard included, is kept."""

from __future__ import annotations

import pytest

from services.rpc.status import INTERNAL_ADDRESS, public_message


@pytest.mark.parametrize(
    ("inner", "public"),
    [
        (
            "shard 0 replica 10.1.2.3:50052: query: 300 distinct terms",
            "shard 0 replica <internal>: query: 300 distinct terms",
        ),
        (
            "shard 1 replica gtr-index-1-0.gtr-index-1.search.svc:50052: unavailable",
            "shard 1 replica <internal>: unavailable",
        ),
        (
            "UNKNOWN: ipv4:127.0.0.1:41661: Failed to connect",
            "UNKNOWN: <internal>: Failed to connect",
        ),
        ("redis at redis://:pw@redis-0:6379/0 is down", "redis at <internal> is down"),
        ("Connect call failed ('127.0.0.1', 32797).", "Connect call failed <internal>."),
        ("triton [::1]:8001: UNAVAILABLE", "triton <internal>: UNAVAILABLE"),
        (
            "shard 1: dns:///gtr-index-1:50052 names no replica",
            "shard 1: <internal> names no replica",
        ),
    ],
)
def test_internal_addresses_are_replaced(inner: str, public: str) -> None:
    assert public_message(inner) == public


@pytest.mark.parametrize(
    "message",
    [
        "k: 0 is out of range 1..1000",
        "write_token: shard 7 does not exist (0..1)",
        "position 5-0, model all-MiniLM-L6-v2 version 2",
        "over the in-flight limit 32 (this one takes 4)",
        "documents[3].metadata[lang]: at most 1024 bytes",
    ],
)
def test_other_texts_are_left_alone(message: str) -> None:
    assert public_message(message) == message
    assert INTERNAL_ADDRESS not in public_message(message)
