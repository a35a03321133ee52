"""An ordinary HTTP client of the gateway's HTTP/JSON port, for tests and benches: the
standard library's ``http.client`` on one keep-alive connection (TLS with a CA), JSON in
and out, nothing of ours in between."""

from __future__ import annotations

import http.client
import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class HttpJson:
    """Requests to ``host:port`` over one connection (reopened when the server closed it);
    HTTPS when ``ca`` names the CA to trust."""

    def __init__(self, host: str, port: int, ca: Path | None = None, token: str | None = None):
        self.host, self.port, self.token = host, port, token
        self.context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self.context is not None:
                self._conn = http.client.HTTPSConnection(
                    self.host, self.port, context=self.context, timeout=120
                )
            else:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        return self._conn

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
        token: str | None = None,
    ) -> Reply:
        """``body`` sent as JSON (or ``raw`` bytes as they are); ``token``, else the
        client's, as ``Authorization: Bearer`` (unless ``headers`` has one)."""
        sent = {"Accept": "application/json", **(headers or {})}
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
        if data is not None:
            sent.setdefault("Content-Type", "application/json")
        bearer = token if token is not None else self.token
        if bearer and "Authorization" not in sent:
            sent["Authorization"] = f"Bearer {bearer}"
        for attempt in (0, 1):
            conn = self._connection()
            try:
                conn.request(method, path, body=data, headers=sent)
                reply = conn.getresponse()
                return Reply(
                    reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
                )
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()  # the server closed a kept-alive connection: once more
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get(self, path: str, **kwargs: Any) -> Reply:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Reply:
        return self.request("POST", path, body, **kwargs)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
