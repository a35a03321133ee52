"""The ``train`` phase: a sample of vectors for the target's quantizer, the training, and
``params["trained"]`` (the target's shards start then).

With a new encoder the sample is the first ``sample`` documents of the SCAN, encoded and
appended (the bulk phase goes on after them); with a retrain it is a reservoir sample of
every vector the source's replicas hold (:mod:`services.generations.retrain`). The
target keeps the source's PQ shape and, when the source searches on GPUs, settings
faiss-gpu accepts (:mod:`services.generations.gpu_serving`).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import FailedPrecondition
from services.generations import documents
from services.generations.context import RolloutContext
from services.generations.encoding import append_documents
from services.generations.gpu_serving import GpuKeep, refusal, source_keep, source_manifest
from services.generations.held import enforce_bound, lag_of
from services.generations.registry import Generation
from services.generations.retrain import export_all
from services.generations.state import ScanCursor
from services.index.core.train import (
    TARGET_RECALL,
    TrainOptions,
    inherited_pq_bits,
    train_index,
)


def next_phase(ctx: RolloutContext) -> str:
    return "bulk" if ctx.state.mode == "encode" else "catch_up"


async def run_train(ctx: RolloutContext) -> None:
    target = ctx.target()
    if target.params.get("trained"):
        ctx.save(phase=next_phase(ctx))
        return
    if ctx.state.mode == "retrain":
        sample = await export_all(ctx, target)
    else:
        sample = await encode_sample(ctx, target)
    if sample.shape[0] == 0:
        raise FailedPrecondition(f"{ctx.state.source}'s documents are none: nothing to train on")
    source, dim = ctx.source(), int(sample.shape[1])
    spec = ctx.registry.addresses(source.name) or ctx.wiring.source_addresses
    keep = await source_keep(source, spec, ctx.wiring.shard_tls, dim)
    if keep.problem:  # a new encoder's dimension, known only once it was published
        raise FailedPrecondition(f"{target.name}: {refusal(keep, source.name, dim)}")
    manifest = await asyncio.to_thread(train, ctx, target, sample, keep)
    params = dict(
        target.params,
        trained=True,
        nprobe=manifest.nprobe,
        nlist=manifest.nlist,
        train_points=manifest.train_points,
        measured_recall=manifest.measured_recall,
    )
    ctx.registry.put(replace(target, params=params))
    ctx.progress.message(
        f"{target.name}: trained on {manifest.train_points} vectors (nlist "
        f"{manifest.nlist}, nprobe {manifest.nprobe}) in {target.index_dir}"
    )
    ctx.save(phase=next_phase(ctx))


def train(ctx: RolloutContext, target: Generation, sample: np.ndarray, keep: GpuKeep) -> Any:
    """Train T's index on ``sample`` with the source's index options (refine, PQ bits
    unless a small sample chose them: :func:`inherited_pq_bits`, pq_m for the same
    dimension) and, for a GPU-bound source, GPU settings."""
    src = source_manifest(ctx.source().index_dir)
    options = TrainOptions(
        max_train_points=ctx.options.sample,
        model=target.encoder.source or target.encoder.model,
        refine=src.get("refine", True),
        refine_factor=int(src.get("refine_factor", 4)),
        pq_bits=inherited_pq_bits(int(src.get("pq_bits", 8)), int(src.get("train_points", 0))),
        pq_m=keep.pq_m,
        gpu=keep.bound,
        target_recall=ctx.options.target_recall or TARGET_RECALL,
    )
    return train_index(sample, Path(target.index_dir), options)


async def encode_sample(ctx: RolloutContext, target: Generation) -> np.ndarray:
    """Encode and append the first ``sample`` documents of the SCAN; the cursor after
    them is where the bulk pass goes on."""
    rows: list[np.ndarray] = []
    have = 0
    cursor = ScanCursor()
    src = ctx.keys(ctx.source())
    total = documents.count(ctx.client, src)
    ctx.save(total=total)
    ctx.progress.total(total)
    embedder, appender = ctx.embedder(target), ctx.appender(target)
    async for batch, after in documents.scan(ctx.client, src, cursor, ctx.options.batch):
        vectors = await append_documents(embedder, appender, batch, target.encoder.dim)
        rows.append(vectors)
        have += vectors.shape[0]
        ctx.progress.advance(len(batch))
        enforce_bound(ctx, lag_of(ctx))  # S's logs held meanwhile
        if have >= ctx.options.sample:
            cursor = after
            break
    else:
        cursor = ScanCursor.done()
    ctx.save(cursor=cursor, done=have)
    dim = target.encoder.dim or (rows[0].shape[1] if rows else 0)
    return np.concatenate(rows) if rows else np.zeros((0, dim), np.float32)
