"""Redis clients for every process: one URL names a single Redis or a Redis Cluster.

- ``redis://[user:password@]host:port/0`` (``rediss://`` with TLS, ``unix://``): one
  Redis (a primary, with replicas for failover behind it or not).
- ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://``
  with TLS): a Redis Cluster; the listed nodes are only the seeds, the client learns the
  slot map from them and follows ``MOVED``/``ASK`` redirects and failovers by itself
  (redis-py's ``RedisCluster``). Query parameters (``?ssl_ca_certs=/path``,
  ``ssl_cert_reqs=none``, ...) are read as for ``redis://`` URLs.

Pipelines on a cluster client are grouped by node (one round trip per node involved);
a transaction or a Lua script must keep its keys in one hash slot, which the key layout
of the change log does (:mod:`services.index.keys`). Keys of other features need no
care beyond that: single-key commands work on any key.

The pool bounds, health checks and retries are the same for both kinds (see
:func:`async_client`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.cluster import ClusterNode
from redis.connection import parse_url
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.retry import Retry

from services.common import timeouts
from services.common.errors import Unauthenticated, Unavailable

log = logging.getLogger(__name__)

# What a Redis restart or a cluster failover raises while it lasts (worth a retry of a read).
TRANSIENT: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterDownError,
    TryAgainError,
    RedisClusterException,
)
T = TypeVar("T")

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SINGLE_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names: a single server or the seed nodes of a cluster."""

    url: str
    cluster: bool
    nodes: tuple[tuple[str, int], ...] = ()
    options: dict[str, Any] = field(default_factory=dict)  # username, password, ssl...

    @property
    def safe_url(self) -> str:
        """The URL without its password (for logs and messages)."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        user = f"{parts.username}:***@" if parts.username else ":***@"
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit(parts._replace(netloc=user + host))


def parse_redis_url(url: str) -> RedisTarget:
    """The target of ``url``; ValueError naming what is wrong with it."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in _SINGLE_SCHEMES:
        parse_url(url)  # raises ValueError on a malformed URL
        return RedisTarget(url=url, cluster=False)
    if scheme not in _CLUSTER_SCHEMES:
        raise ValueError(
            f"redis URL {url!r}: the scheme must be redis://, rediss://, unix:// (one Redis) "
            "or redis+cluster://, rediss+cluster:// (a Redis Cluster: host:port,host:port)"
        )
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"redis URL {url!r}: cluster node {item!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"redis URL {url!r}: a Redis Cluster has only database 0")
    # Credentials and query options are read as for one server's URL.
    single = urlunsplit(
        (
            _CLUSTER_SCHEMES[scheme],
            f"{userinfo}@{hosts.split(',')[0]}" if userinfo else hosts.split(",")[0],
            "",
            parts.query,
            "",
        )
    )
    options = parse_url(single)
    for key in ("host", "port", "db", "path", "connection_class"):
        options.pop(key, None)
    if scheme == "rediss+cluster":
        options["ssl"] = True
    if options.get("username"):
        options["username"] = unquote(options["username"])
    return RedisTarget(url=url, cluster=True, nodes=tuple(nodes), options=options)


def check_redis_url(url: str) -> str:
    """``url`` when it names a Redis or a Redis Cluster (a settings validator)."""
    parse_redis_url(url)
    return url


def read_redis_url(path: str) -> str:
    """The Redis URL on the first line of the file ``path`` (``--redis-url-file``: a URL
    with a password stays off command lines, which every local user sees in ``ps``).
    ValueError naming the file, never quoting its content (it may hold a password)."""
    from pathlib import Path

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the Redis URL file {path}: {exc.strerror}") from None
    url = lines[0].strip() if lines else ""
    try:
        return check_redis_url(url)
    except ValueError:
        raise ValueError(
            f"the Redis URL file {path} does not hold a redis://, rediss://, unix://, "
            "redis+cluster:// or rediss+cluster:// URL on its first line"
        ) from None


# A blocking client as sync_client makes it: one Redis or a cluster (bytes replies). The
# registry and the rollout builder take it; redis-py types its replies loosely (Any).
SyncRedis = redis.Redis | redis.cluster.RedisCluster


def sync_client(url: str, *, socket_timeout: float = 5.0) -> Any:
    """A blocking client (``redis.Redis`` or ``redis.cluster.RedisCluster``); replies are
    bytes. Used by threads that block on the log (``XREAD``) and by the command line."""
    target = parse_redis_url(url)
    if not target.cluster:
        return redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            health_check_interval=1,
        )
    return redis.cluster.RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        health_check_interval=1,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), 6),
        **target.options,
    )


def unreachable(url: str, to: str, exc: BaseException) -> Unavailable:
    """The one wording of a store that cannot be reached: "Redis at <url without its
    password> cannot be reached to <to> (<error>)"."""
    return Unavailable(
        f"Redis at {parse_redis_url(url).safe_url} cannot be reached to {to} ({exc})"
    )


def answering_client(url: str, *, to: str, socket_timeout: float = 5.0) -> Any:
    """A blocking client of ``url`` that answered a PING, for a command that asks the
    store once and should say at once why it cannot (:func:`with_sync_client` waits for
    a store that is starting). Unavailable (:func:`unreachable`) when it cannot be
    reached, a cluster's seed nodes included (that client connects when it is made);
    Unauthenticated when it refuses the credentials; Unavailable naming any other refusal
    (a TLS handshake, a server that is not Redis)."""
    shown = parse_redis_url(url).safe_url
    client = None
    try:
        client = sync_client(url, socket_timeout=socket_timeout)
        client.ping()
        return client
    except AuthenticationError as exc:
        failure: Exception = Unauthenticated(
            f"Redis at {shown} refused the credentials of its URL ({exc})"
        )
    except TRANSIENT as exc:
        failure = unreachable(url, to, exc)
    except RedisError as exc:
        failure = Unavailable(f"Redis at {shown} refused the connection to {to} ({exc})")
    if client is not None:
        client.close()
    raise failure


def with_sync_client(url: str, use: Callable[[Any], T], *, to: str, wait_s: float) -> T:
    """``use(client)`` on a blocking client of ``url``, closed after, for a process that
    starts: while Redis cannot be reached (a pod starting before Redis), tried again every
    second for up to ``wait_s``, then Unavailable, "Redis at <url without its password>
    cannot be reached to <to> (<error>)". A cluster client connects when it is made, so it
    is made on every try. Any other error of ``use`` is raised at once."""
    import time

    give_up = time.monotonic() + wait_s
    while True:
        try:
            client = sync_client(url)
            try:
                return use(client)
            finally:
                client.close()
        except TRANSIENT as exc:
            if time.monotonic() > give_up:
                raise unreachable(url, to, exc) from exc
            log.warning("Redis cannot be reached yet (%s); trying again", exc)
            time.sleep(1.0)


def async_client(
    url: str,
    *,
    max_connections: int = 64,
    pool_timeout_s: float = 5.0,
    socket_timeout: float = 5.0,
) -> Any:
    """An asyncio client (``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster``).

    One Redis: a bounded, blocking pool (:func:`redis_pool`). A cluster: at most
    ``max_connections`` sockets per node; redis-py's cluster client fails at once when
    they are all busy, so callers bound their concurrency with :class:`Gate` (the
    change-log writer does) to wait instead, as on one Redis. The cluster client retries
    a command that meets a failover (connection refused, ``CLUSTERDOWN``,
    ``TRYAGAIN``) after refreshing the slot map, with jittered backoff (0.05 s doubled,
    at most 0.5 s, 6 times: about the few seconds a replica takes to be promoted).
    """
    target = parse_redis_url(url)
    if not target.cluster:
        return aioredis.Redis.from_pool(
            redis_pool(
                url,
                max_connections=max_connections,
                timeout=pool_timeout_s,
                socket_timeout=socket_timeout,
            )
        )
    return aioredis.RedisCluster(
        startup_nodes=[AsyncClusterNode(h, p) for h, p in target.nodes],
        max_connections=max_connections,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        health_check_interval=1,
        retry=AsyncRetry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), 6),
        **target.options,
    )


def redis_pool(
    url: str, *, max_connections: int, timeout: float, socket_timeout: float = 5.0
) -> aioredis.BlockingConnectionPool:
    """A bounded pool for an asyncio client of one Redis: at most ``max_connections``
    sockets; a caller that finds them all busy waits up to ``timeout`` s for one (then
    ConnectionError) instead of failing at once ("Too many connections", redis-py's
    default pool).

    Connections idle for over a second are PINGed before use, so a pool that outlived a
    Redis restart reconnects instead of failing its next requests; a command that fails
    on a broken connection is retried once on a fresh one. A retried write may run twice
    when the first attempt reached Redis and only its reply was lost: an upsert is then
    logged twice (same content, a newer version), harmless for every reader.
    """
    return aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        health_check_interval=1,
        retry=AsyncRetry(NoBackoff(), 1),
        retry_on_error=[redis.ConnectionError],
    )


def is_cluster(client: Any) -> bool:
    return isinstance(client, aioredis.RedisCluster | redis.cluster.RedisCluster)


class Gate:
    """At most ``limit`` operations at once; the next waits up to ``timeout_s`` for a
    place, then ``redis.ConnectionError`` (what a full blocking pool raises)."""

    def __init__(self, limit: int, timeout_s: float) -> None:
        self._slots = asyncio.Semaphore(limit)
        self.timeout_s = timeout_s

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        try:
            await timeouts.wait_for(self._slots.acquire(), self.timeout_s)
        except TimeoutError:
            raise redis.ConnectionError(
                f"no free Redis connection within {self.timeout_s:g} s"
            ) from None
        try:
            yield
        finally:
            self._slots.release()
