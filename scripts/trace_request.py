"""Which hand-written files one request runs through: the count docs/architecture.md's
walk-throughs ("Follow one search", "Follow one upsert") are checked against.

    python scripts/trace_request.py                     # encoder on a real Triton server
    python scripts/trace_request.py --encoder inprocess

Starts, in this one process, a real Redis, two index shards (one replica each), the
rerank service and the gateway (the stack of tests/e2e/test_gateway_rerank.py), warms
them up (streams opened, the shared quantizer fetched, lazy imports done), then runs a
Python profiler while exactly one request is in flight: a Search (EVENTUAL, no filter,
no rerank, the gateway's default mode: hybrid), the same Search in dense mode, the dense
Search with rerank (its depth chosen by the time left), and an Upsert of one document
until the replica of its shard has applied it. It prints, per
request, every file of services/ one of whose functions ran (with the functions and the
thread), then the counts as a JSON line.

Files that only define the data a request carries (the dataclasses of
services/common/domain.py, services/gateway/domain.py, services/common/limits.py) run no
function of their own (a dataclass's __init__ is generated code) and are not counted.
Background work is kept out: the health watchers are slowed to once an hour, and the
replica's log consumer thread counts only for the Upsert (it is what applies it). Needs
redis-server, the SciFact vectors of ../shared/data and, with --encoder triton, the
Triton server of nvidia-pytriton (as the integration tests do).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# What the profiler records: file → thread name → functions, while `recording` is set.
_calls: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
_recording = threading.Event()
_SERVICES = str(ROOT / "services") + "/"


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event != "call" or not _recording.is_set():
        return
    path = frame.f_code.co_filename
    if path.startswith(_SERVICES):
        _calls[path[len(str(ROOT)) + 1 :]][threading.current_thread().name].add(
            frame.f_code.co_name
        )


@contextmanager
def recorded(name: str, report: dict[str, int], background: bool = False) -> Iterator[None]:
    """Record the calls of the block; ``background``: count the replica's log consumer."""
    _calls.clear()
    _recording.set()
    try:
        yield
    finally:
        _recording.clear()
    files = {
        path: threads
        for path, threads in sorted(_calls.items())
        if background or set(threads) != {"log-consumer"}
    }
    print(f"\n{name}: {len(files)} files")
    for path, threads in files.items():
        print(f"  {path}")
        for thread, functions in sorted(threads.items()):
            print(f"      [{thread}] {', '.join(sorted(functions))}")
    report[name] = len(files)


async def trace(encoder: str, tmp: Path, stack: ExitStack) -> dict[str, int]:
    import grpc
    import numpy as np

    from retrieval.v1 import (
        common_pb2,
        documents_pb2,
        documents_pb2_grpc,
        search_pb2,
        search_pb2_grpc,
    )
    from services.gateway.server import start_gateway
    from services.gateway.settings import GatewaySettings
    from services.index.core.train import TrainOptions, train_index
    from services.index.server.process import start_shard
    from services.rerank.serve.server import start_rerank
    from services.rerank.serve.settings import RerankSettings
    from tests.support.processes import run_redis
    from tests.support.rerank import WORDS, tiny_checkpoint
    from tests.support.stack import shard_settings

    vectors = np.load(ROOT.parent / "shared/data/scifact/corpus.all-MiniLM-L6-v2.npy")[:3000]
    train_index(vectors, tmp / "index", TrainOptions(nlist=8, nprobe=8, model="all-MiniLM-L6-v2"))
    triton_url = "127.0.0.1:1"
    if encoder == "triton":
        from services.encoder.build.repository import RepositoryConfig, generate_repository
        from services.encoder.model import default_model_dir
        from services.encoder.serve.triton_server import TritonServerConfig, run_triton
        from tests.encoder_fixtures import ensure_onnx
        from tests.support.processes import free_port

        onnx = ensure_onnx(default_model_dir(), tmp / "encoder")
        generate_repository(onnx, tmp / "repo", RepositoryConfig(instances=1, intra_op_threads=1))
        cfg = TritonServerConfig(
            tmp / "repo",
            grpc_port=free_port(),
            http_port=free_port(),
            metrics_port=free_port(),
            startup_timeout_s=90,
        )
        triton_url = stack.enter_context(run_triton(cfg, tmp / "triton.log")).grpc_url
    redis = stack.enter_context(run_redis(tmp / "redis"))
    quiet = {"health_interval_s": 3600.0}  # no health check fires during a window
    shards = []
    for s in range(2):
        settings = shard_settings(s, 2, 0, redis.url, tmp / "index", tmp).model_copy(update=quiet)
        shards.append(await start_shard(settings))
    checkpoint = tiny_checkpoint(tmp / "rerank", WORDS)
    reranker = await start_rerank(RerankSettings(port=0, checkpoint=str(checkpoint), threads=1))
    gateway = await start_gateway(
        GatewaySettings(
            port=0,
            redis_url=redis.url,
            shards=";".join(f"127.0.0.1:{s.port}" for s in shards),
            encoder=encoder,  # type: ignore[arg-type]
            triton_url=triton_url,
            rerank_url=f"127.0.0.1:{reranker.port}",
            auth=False,
            **quiet,
        )
    )
    report: dict[str, int] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            documents = documents_pb2_grpc.DocumentServiceStub(channel)
            search = search_pb2_grpc.SearchServiceStub(channel)
            docs = [
                documents_pb2.Document(id=f"d{i:02d}", title=f"topic {i}", text=f"{w} doc {i}")
                for i, w in enumerate(WORDS * 2)
            ]
            token = (
                await documents.Upsert(documents_pb2.UpsertRequest(documents=docs))
            ).write_token
            plain = search_pb2.SearchRequest(query="read a csv file", k=3)  # default mode
            dense = search_pb2.SearchRequest(
                query="read a csv file", k=3, mode=search_pb2.RETRIEVAL_MODE_DENSE
            )
            reranked = search_pb2.SearchRequest(
                query="read a csv file",
                k=3,
                mode=search_pb2.RETRIEVAL_MODE_DENSE,
                rerank=search_pb2.RerankOptions(enabled=True),
            )
            # SESSION: every document above is searchable before the windows
            warm = search_pb2.SearchRequest(
                query="csv", k=3, write_token=token, consistency=common_pb2.CONSISTENCY_SESSION
            )
            for _ in range(3):
                await search.Search(warm, timeout=30)
                await search.Search(plain, timeout=30)
                await search.Search(dense, timeout=30)
                await search.Search(reranked, timeout=30)

            with recorded("search", report):
                found = await search.Search(plain, timeout=30)
            assert len(found.hits) == 3 and not found.reranked, found
            if found.sparse_missing_shards:  # the shards have no text index: dense only
                print(f"\nthe default search's sparse lists are missing: {found}")
            with recorded("search_dense", report):
                found = await search.Search(dense, timeout=30)
            assert len(found.hits) == 3 and found.mode == search_pb2.RETRIEVAL_MODE_DENSE, found
            with recorded("search_reranked", report):
                found = await search.Search(reranked, timeout=30)
            assert found.reranked, found

            one = documents_pb2.Document(id="new-1", title="t", text="read json rows")
            with recorded("upsert_until_applied", report, background=True):
                written = await documents.Upsert(
                    documents_pb2.UpsertRequest(documents=[one]), timeout=30
                )
                (position,) = written.write_token.positions
                replica = shards[position.shard].replica
                until = time.monotonic() + 10
                while replica.shard.applied < position.position and time.monotonic() < until:
                    await asyncio.sleep(0.002)
            assert replica.shard.applied >= position.position
    finally:
        await gateway.close(0)
        await reranker.close(0)
        for shard in shards:
            await shard.close(0, snapshot=False)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", choices=("triton", "inprocess"), default="triton")
    args = parser.parse_args(argv)
    threading.setprofile(_profile)  # type: ignore[arg-type]
    sys.setprofile(_profile)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        report = asyncio.run(trace(args.encoder, Path(tmp), stack))
    sys.setprofile(None)
    print(json.dumps({"encoder": args.encoder, "files": report}))


if __name__ == "__main__":
    main()
