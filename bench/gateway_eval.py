"""``gtr-retrieval eval`` through a real gateway on the shared SciFact, without encoding
the corpus again.

    .venv/bin/python -m bench.gateway_eval [--data ../shared/data/scifact]

Trains the index on the shared all-MiniLM-L6-v2 embeddings of the corpus, logs every
document (title, text and its embedding) through the change log of a real Redis, starts
2 shard servers and the gateway (in-process MiniLM encoder for the queries) on free
ports, then runs ``gtr-retrieval eval --gateway ADDR --no-ingest``: every retrieval mode
as a client asks for it, side by side on the same queries (docs/index.md, "Text index").
The same as ``gtr-retrieval up --corpus .../corpus.jsonl`` + ``eval --gateway``, minus
the six minutes of encoding the corpus.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.index_service import SCIFACT
from services.cli.main import main as cli
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.train import TrainOptions, train_index
from tests.support.background import stack_in_background
from tests.support.processes import run_redis

SHARDS = 2  # tests.support.stack's default


async def log_corpus(url: str, rows: list[dict[str, str]], vectors: np.ndarray) -> None:
    writer = ChangeLogWriter.connect(url, SHARDS, dim=vectors.shape[1])
    try:
        for i in range(0, len(rows), 256):
            await writer.upsert(
                [
                    DocRecord(r["_id"], vectors[i + j], r.get("title", ""), r["text"])
                    for j, r in enumerate(rows[i : i + 256])
                ]
            )
    finally:
        await writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=SCIFACT, help="BEIR folder.")
    args = parser.parse_args()
    vectors = np.load(args.data / "corpus.all-MiniLM-L6-v2.npy")
    with (args.data / "corpus.jsonl").open(encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    with tempfile.TemporaryDirectory(prefix="gtr-gateway-eval-") as tmp_name:
        tmp = Path(tmp_name)
        train_index(vectors, tmp / "index", TrainOptions(model="all-MiniLM-L6-v2"))
        with run_redis(tmp / "redis") as redis_server:
            asyncio.run(log_corpus(redis_server.url, rows, vectors))
            with stack_in_background(redis_server.url, tmp / "index", tmp) as bg:
                return cli(
                    [
                        "eval",
                        "--data",
                        str(args.data),
                        "--gateway",
                        bg.address,
                        "--no-ingest",
                        "--quiet",
                        "--timeout",
                        "60",
                    ]
                )


if __name__ == "__main__":
    sys.exit(main())
