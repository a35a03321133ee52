"""A trivial gateway-API server that answers one search at a time, ``--service-ms``
each (capacity 1000/service-ms per second), in a process of its own: the sweep tests'
server, kept off the load generator's event loop (sharing it, the calls queued at twice
the capacity put the generator itself behind its schedule).

``python -m tests.support.serial_server --service-ms 20`` prints ``listening on ADDR``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any


async def _serve(service_s: float) -> None:
    from loadtest.trivial_server import start_trivial_server

    lock = asyncio.Lock()

    async def serial(request: Any, context: Any) -> None:
        async with lock:
            await asyncio.sleep(service_s)

    server, port, _ = await start_trivial_server(0, serial)
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--service-ms", type=float, required=True)
    asyncio.run(_serve(parser.parse_args().service_ms / 1000.0))


@contextlib.contextmanager
def serial_server_process(service_s: float) -> Iterator[str]:
    """The server in a child process; yields its address."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.serial_server",
            "--service-ms",
            str(1000 * service_s),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            raise RuntimeError(f"serial server did not start: {line!r}")
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
