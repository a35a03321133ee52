"""A stopping shard ends the router's search streams itself, once their running searches
have answered.

The router keeps one ``SearchStream`` per replica open for as long as the replica runs
(services/index/client/replicas.py). A stream is one gRPC call, so a replica's drain on
SIGTERM used to wait for it to its whole grace (5 s by default) and then cancel it: ``up``
stopping a stack's shards one after the other took 5 s a shard (37 s at the end of
tests/integration/test_generations_e2e.py). Now the replica stops reading each stream,
lets the searches it already runs answer, and ends the stream with OK; the router takes
the end as UNAVAILABLE for anything it still waits on, and asks the next replica.

A real replica process on the session's Redis. Its grace is 120 s here, so a stream that
still held the drain would end with the grace, cancelled, not OK. A search is held in
flight by a SESSION wait for a log position never written (tests/support/log_end.py),
bounded by its own budget.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common.domain import Consistency
from services.index import convert
from services.index.core.query import ShardQuery
from tests.support.log_end import FUTURE, log_end_moved
from tests.support.shards import one_fed_shard_index, start_shard

GRACE_S = 120.0
HELD_BUDGET_S = 2.0


def test_a_stopping_shard_answers_its_running_searches_and_ends_its_streams(
    redis_url: str, scifact_dir: Path, tmp_path: Path
) -> None:
    vectors, index_dir = one_fed_shard_index(redis_url, scifact_dir, tmp_path, 200)
    shard = start_shard(
        index_dir=index_dir,
        redis_url=redis_url,
        shard=0,
        shards=1,
        work_dir=tmp_path,
        settings={"grace-seconds": str(GRACE_S)},
    )

    def message(tag: int, consistency: Consistency, position: str = "") -> object:
        query = ShardQuery(0, vectors[:1], 5, consistency=consistency, min_position=position)
        return index_pb2.ShardStreamRequest(
            tag=tag,
            search=convert.query_to_pb(query),
            timeout_us=int(HELD_BUDGET_S * 1e6),
        )

    async def run() -> tuple[list[index_pb2.ShardStreamResponse], grpc.StatusCode]:
        async with grpc.aio.insecure_channel(shard.address) as channel:
            call = index_pb2_grpc.IndexShardServiceStub(channel).SearchStream()
            await call.write(message(1, Consistency.SESSION, FUTURE))  # held until its budget
            await call.write(message(2, Consistency.EVENTUAL))
            first = await call.read()  # the stream is read in order: 1 runs once 2 answered
            assert first is not grpc.aio.EOF and first.tag == 2 and first.status_code == 0
            assert shard.process is not None
            shard.process.send_signal(signal.SIGTERM)
            replies = []
            while (reply := await call.read()) is not grpc.aio.EOF:
                replies.append(reply)
            return replies, await call.code()

    try:
        with log_end_moved(redis_url, [0]):
            replies, code = asyncio.run(run())
        assert shard.process is not None
        assert shard.process.wait(GRACE_S) == 0, shard.log_tail()
    finally:
        shard.stop()
    # the held search answered for itself (its budget ran out), then the stream ended
    assert [r.tag for r in replies] == [1], replies
    assert replies[0].status_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], replies[0]
    assert code == grpc.StatusCode.OK, code
