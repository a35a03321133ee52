"""services/process/ports.py: ports to listen on below the kernel's ephemeral range."""

from __future__ import annotations

import itertools
import random
import socket
from pathlib import Path

import pytest

from services.process import ports


def test_a_listen_port_is_below_the_ephemeral_range_and_free() -> None:
    low, _ = ports.ephemeral_range()
    for seed in range(20):
        port = ports.listen_port(rng=random.Random(seed))
        assert ports.LOWEST <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # nothing listens there


def test_a_port_taken_by_a_listener_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = itertools.chain([busy, busy], itertools.count(busy + 1))  # the busy one twice
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (65000, 65535))
        monkeypatch.setattr(ports, "LOWEST", 1024)

        class Picks(random.Random):
            def randrange(self, *args: object, **kwargs: object) -> int:  # type: ignore[override]
                return next(picks)

        assert ports.listen_port(rng=Picks()) > busy


def test_the_range_file_is_read_and_a_missing_one_falls_back(tmp_path: Path) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ports.ephemeral_range(path) == (40000, 50000)
    assert ports.ephemeral_range(tmp_path / "absent") == (32768, 60999)
