"""Measured figures the planner builds on, read from ``bench/results/*.json``.

Each figure keeps its source (file, bench, run), so every number the plan prints says
where it came from. A missing or malformed file is a :class:`NotFound` /
:class:`InvalidArgument` naming the bench that writes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import InvalidArgument, NotFound

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@dataclass(frozen=True)
class Figure:
    value: float
    source: str  # "bench/results/x.json: key (bench, run)"


@dataclass(frozen=True)
class Measured:
    # index (bench.index_service): one IVF-PQ corpus on 2 shards, tuned nprobe
    index_vectors: Figure  # vectors indexed in the bench
    index_dim: Figure
    index_nprobe_share: Figure  # nprobe / nlist of the bench
    index_nlist: Figure
    shard_cpu_us_per_query: Figure  # CPU of all shards together per query
    router_cpu_us_per_query: Figure  # the client + router (gateway side) per query
    bytes_per_vector: Figure
    # encoder (bench.encoder), all-MiniLM-L6-v2 on CPU
    cpu_encoder_texts_per_s: Figure
    cpu_encoder_cores: Figure
    cpu_encoder_p99_ms: Figure
    # rerank (bench.rerank): ms per query by depth on CPU threads
    rerank_ms_at_depth: dict[int, Figure]
    rerank_threads: Figure
    # text index (bench.hybrid): bytes on disk per document, and the corpus' mean
    # title + text bytes it was measured on (None: not measured, no text lines in the plan)
    text_bytes_per_doc: Figure | None = None
    text_doc_bytes: Figure | None = None


def _read(folder: Path, name: str, bench: str) -> dict[str, Any]:
    path = folder / name
    if not path.exists():
        raise NotFound(f"{path} not found: run `python -m bench.{bench}` (it writes it)")
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"{path}: not a JSON object ({exc})") from None


def _figure(data: dict[str, Any], name: str, *keys: str) -> Figure:
    value: Any = data
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise InvalidArgument(f"{name}: no {'.'.join(keys)}")
        value = value[key]
    run = data.get("source", {}).get("run", "")
    return Figure(float(value), f"{name}: {'.'.join(keys)}" + (f" ({run})" if run else ""))


def load(folder: Path = RESULTS) -> Measured:
    folder = Path(folder)
    idx = _read(folder, "index_service.json", "index_service")
    enc = _read(folder, "encoder.json", "encoder")
    rr = _read(folder, "rerank_depths.json", "rerank")
    hy = _read(folder, "hybrid.json", "hybrid")
    i, e, r, h = (
        f"bench/results/{n}"
        for n in ("index_service.json", "encoder.json", "rerank_depths.json", "hybrid.json")
    )
    nprobe, nlist = idx.get("nprobe"), idx.get("nlist")
    if not nprobe or not nlist:
        raise InvalidArgument(f"{i}: needs nprobe and nlist")
    depths = {
        int(d): Figure(float(ms), f"{r}: ms_per_query_at_depth.{d}")
        for d, ms in rr.get("ms_per_query_at_depth", {}).items()
    }
    if not depths:
        raise InvalidArgument(f"{r}: no ms_per_query_at_depth")
    return Measured(
        index_vectors=_figure(idx, i, "vectors"),
        index_dim=Figure(float(idx.get("dim", 384)), f"{i}: all-MiniLM-L6-v2, 384-d"),
        index_nprobe_share=Figure(nprobe / nlist, f"{i}: nprobe {nprobe} / nlist {nlist}"),
        index_nlist=_figure(idx, i, "nlist"),
        shard_cpu_us_per_query=_figure(idx, i, "cpu_us_per_query", "shards"),
        router_cpu_us_per_query=_figure(idx, i, "cpu_us_per_query", "router"),
        bytes_per_vector=_figure(idx, i, "bytes_per_vector"),
        cpu_encoder_texts_per_s=_figure(enc, e, "triton_texts_per_s"),
        cpu_encoder_cores=_figure(enc, e, "cores"),
        cpu_encoder_p99_ms=_figure(enc, e, "triton_p99_ms"),
        rerank_ms_at_depth=depths,
        rerank_threads=_figure(rr, r, "source", "threads"),
        text_bytes_per_doc=_figure(hy, h, "text_bytes_per_document"),
        text_doc_bytes=_figure(hy, h, "text_doc_bytes"),
    )
