"""A log position that a SESSION search waits for until its deadline.

A shard refuses (INVALID_ARGUMENT) a position past the newest id ever written to its log
(the stream's last-generated-id): no wait could reach it. A test that needs a search to
wait (a deadline, a request held in flight) therefore moves the log's end forward with
``XSETID`` without writing an entry: the position is then "written" as far as the check
goes, yet no entry for the replica to apply ever arrives. A replica remembers the newest
end it has read (it only grows), so a position the moved end covered stays "written" for
it after the end is moved back: a test that needs a past-the-end refusal uses a position
past ``FUTURE``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

import redis

from services.index.keys import log_key

FUTURE = "99999999999999-0"  # a log position no shard reaches during a test


@contextmanager
def log_end_moved(redis_url: str, shards: Sequence[int], position: str = FUTURE) -> Iterator[str]:
    """While inside: the logs of ``shards`` end at ``position`` (yielded). On exit each
    log's end goes back to where it was, unless entries were written meanwhile."""
    client = redis.Redis.from_url(redis_url)
    before: dict[int, str] = {}
    try:
        for shard in shards:
            key = log_key(shard)
            if not client.exists(key):  # an empty stream (XSETID needs one to exist)
                client.xgroup_create(key, "log-end", id="$", mkstream=True)
                client.xgroup_destroy(key, "log-end")
            before[shard] = client.xinfo_stream(key)["last-generated-id"].decode()
            client.execute_command("XSETID", key, position)
        yield position
    finally:
        for shard, last in before.items():
            # entries written after ``position`` make this fail: the end stays past them
            with suppress(redis.ResponseError):
                client.execute_command("XSETID", log_key(shard), last)
        client.close()
