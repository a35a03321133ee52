"""A real gRPC server whose one method fails on cue, for the tests of client retries.

It stands for a server that is restarting or busy (a Triton, a gateway), which cannot be
made to fail on cue: it fails the first ``failures`` calls with ``code`` (and the
trailing metadata a real one sends with it, e.g. the gateway's ``retry-after-ms``), then
answers, and counts the attempts and when each arrived.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc


@dataclass
class Script:
    """Fail the first ``failures`` calls with ``code`` (and ``trailing`` metadata), then
    answer ``reply``; ``arrivals`` holds each attempt's time.monotonic()."""

    code: grpc.StatusCode
    failures: int
    reply: bytes = b""
    trailing: tuple[tuple[str, str], ...] = ()
    attempts: int = 0
    arrivals: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.lock:
            self.attempts += 1
            self.arrivals.append(time.monotonic())
            attempt = self.attempts
        if attempt <= self.failures:
            if self.trailing:
                context.set_trailing_metadata(self.trailing)
            context.abort(self.code, f"scripted failure {attempt}")
        return self.reply


@contextmanager
def scripted_server(service: str, method: str, script: Script) -> Iterator[str]:
    """``service``/``method`` served by ``script`` (raw bytes in and out) on a free port;
    its ``host:port``."""
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    handler = grpc.unary_unary_rpc_method_handler(script.handle)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {method: handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)
