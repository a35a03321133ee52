"""Ports for a local server to listen on: free now, and outside the kernel's range of
ephemeral ports.

Asking the kernel for port 0 hands out a port from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the range every
outgoing connection's local port comes from too. A port chosen that way and given to a
child that binds it seconds later can meanwhile be the local end of some connection, and
stays taken while that lives: a CI run's shard failed to bind its port six times in 20 s
("Address already in use") and ``up`` gave up. A port below the range is never an
outgoing connection's, so only another listener can take it, which the bind here checks.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: the well-known and registered services' usual ports
TRIES = 200


def ephemeral_range(path: Path = RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default when it cannot be read)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def listen_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port ``host`` can listen on now, below the ephemeral range when there is room
    (else the kernel's choice)."""
    low, _ = ephemeral_range()
    rng = rng or random.SystemRandom()
    if low - 1 > LOWEST:
        for _ in range(TRIES):
            port = rng.randrange(LOWEST, low)
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue  # a listener, or a socket still closing on it
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
