"""``python -m tests.support.rollout_runner``: the rollout builder in a process of its own,
re-embedding with the encoder in this process (no Triton), so a test can kill -9 it
mid-way and run it again (tests/integration/test_rollout_builder.py).

    python -m tests.support.rollout_runner --redis-url URL --index-root DIR
        [--shards N] [--batch B] [--sample S]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from services.encoder.base import Encoder
from services.encoder.runtime.inprocess import InProcessEncoder
from services.generations.builder import RolloutBuilder, RolloutOptions, RolloutPlan
from services.generations.registry import EncoderSpec
from services.process.redis_client import sync_client


async def _main(args: argparse.Namespace) -> int:
    async def encoders(spec: EncoderSpec) -> Encoder:
        return InProcessEncoder.torch(threads=1)

    options = RolloutOptions(
        index_root=Path(args.index_root),
        batch=args.batch,
        sample=args.sample,
        wait_for_shards=False,
        stale_after_s=5.0,
    )
    builder = RolloutBuilder(sync_client(args.redis_url), encoders, options)
    serving = await builder.rollout(RolloutPlan(num_shards=args.shards))
    print(f"serving {serving.name}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--index-root", required=True)
    parser.add_argument("--shards", type=int, default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--sample", type=int, default=300)
    return asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
