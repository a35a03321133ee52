"""What stale entries cost a search on the GPU copy (issue #37 item 3).

    .venv/bin/python -m bench.gpu_stale [--n 20000] [--dim 768] [--stale 0.02]
        [--batch 32] [--k 10,100] [--rounds 30] [--out bench/results/gpu_stale.json]

No GPU here: the "copy" is a CPU clone of the shard's IVF-PQ (``faiss.clone_index``), made
and searched through :class:`~services.index.core.gpu.GpuMirror` exactly as the GPU copy
is, so every figure is the mirror's own work plus a CPU search standing in for the GPU's.
``n`` random unit vectors (768-d, IVF256,PQ96: a ``--gpu`` GTR index), then ``--stale`` of
them made stale (half upserted again with new vectors, half deleted), as the shard's
apply does it (remove, then add). For each k, the same batch of ``--batch`` queries (noisy
copies of corpus vectors, a quarter of them near a moved one) is searched on

- the mirror with the stale entries (over-fetch, drop, aliases mapped: :mod:`.gpu_stale`),
- a mirror copied afresh from the same CPU index (no stale ids): the baseline,

and the ratio of their median times per batch is the figure (target <= 1.2). The shard
asks the mirror for ``k * refine_factor`` (4) candidates, so k=10 is a fetch of 40. Also
printed: the drop step alone, and the loop it replaced (one ``reconstruct`` per stale hit
in Python, kept here as ``old_drop_stale``) on the grid of a copy as it was before aliases
(the ids added again under themselves). Prints one JSON
line last (``--out`` writes it too).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from services.index.core.gpu import GpuMirror
from services.index.core.gpu_stale import StaleIds, drop_stale, members

REFINE_FACTOR = 4


def _unit(n: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def old_drop_stale(
    queries: np.ndarray, scores: np.ndarray, ids: np.ndarray, k: int, stale: np.ndarray, cpu: Any
) -> tuple[np.ndarray, np.ndarray]:
    """The loop before issue #37 (inner product only): one ``reconstruct`` per stale hit."""
    is_stale = members(stale, ids)
    if not is_stale.any():
        return scores[:, :k], ids[:, :k]
    out_scores, out_ids = scores[:, :k].copy(), ids[:, :k].copy()
    for row in np.flatnonzero(is_stale.any(axis=1)).tolist():
        out_scores[row], out_ids[row] = -np.inf, -1
        hits: dict[int, float] = {}
        entries = zip(ids[row].tolist(), scores[row].tolist(), is_stale[row], strict=True)
        for fid, score, outdated in entries:
            if fid < 0 or fid in hits:
                continue
            if outdated:
                try:
                    vector = cpu.reconstruct(fid)
                except RuntimeError:
                    continue
                score = float(queries[row] @ vector)
            hits[fid] = score
        best = sorted(hits.items(), key=lambda h: h[1], reverse=True)[:k]
        out_ids[row, : len(best)] = [f for f, _ in best]
        out_scores[row, : len(best)] = [s for _, s in best]
    return out_scores, out_ids


def _median_ms(*fns: Callable[[], object], rounds: int) -> list[float]:
    """The median time of each of ``fns`` in ms, run in turn within every round (so a
    load that comes and goes on a shared machine weighs on all of them alike)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, spent in zip(fns, times, strict=True):
            t = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - t)
    return [statistics.median(spent) * 1000 for spent in times]


def _index(args: argparse.Namespace, x: np.ndarray) -> Any:
    index = faiss.index_factory(args.dim, "IVF256,PQ96x8", faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.extract_index_ivf(index)
    ivfpq: Any = faiss.downcast_index(ivf)
    ivfpq.do_polysemous_training = False  # as index train does (minutes saved)
    index.train(x[: min(len(x), 20_000)])
    ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
    ivf.nprobe = 16
    index.add_with_ids(x, np.arange(len(x), dtype=np.int64))
    return index


@dataclass
class _Copies:
    mirror: GpuMirror  # with the stale entries (and aliases)
    clean: GpuMirror  # copied afresh from the same CPU index
    legacy: Any  # the copy as the old loop saw it: ids added again under themselves
    index: Any  # the CPU index


def _measure(args: argparse.Namespace, k: int, q: np.ndarray, c: _Copies) -> dict[str, Any]:
    """One k: the batch on the stale mirror and on the fresh one, and the drop step."""
    mirror, clean, index = c.mirror, c.clean, c.index
    fetch = k * REFINE_FACTOR
    params = faiss.SearchParametersIVF(nprobe=16)  # type: ignore[call-arg]
    assert mirror.index is not None
    scores, ids = mirror.index.search(q, mirror._fetch(fetch), params=params)
    old_scores, old_ids = c.legacy.search(q, mirror._fetch(fetch), params=params)
    sets: StaleIds = mirror.sets
    old_stale = np.union1d(sets.stale, sets.alias_of)
    clean_ms, stale_ms = _median_ms(
        lambda: clean.search(q, fetch, 16), lambda: mirror.search(q, fetch, 16), rounds=args.rounds
    )
    drop_ms, old_ms = _median_ms(
        lambda: drop_stale(scores, ids, fetch, sets),
        lambda: old_drop_stale(q, old_scores, old_ids, fetch, old_stale, index),
        rounds=args.rounds,
    )
    row: dict[str, Any] = {
        "k": k,
        "fetch": fetch,
        "over_fetch": mirror._fetch(fetch),
        "rows_with_stale_hits": int(members(sets.stale, ids).any(axis=1).sum()),
        "ms_per_batch_no_stale": clean_ms,
        "ms_per_batch_stale": stale_ms,
        "drop_stale_ms": drop_ms,
        "old_loop_ms": old_ms,
    }
    row["ratio"] = row["ms_per_batch_stale"] / row["ms_per_batch_no_stale"]
    print(json.dumps(row))
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    x = _unit(args.n, args.dim, rng)
    index = _index(args, x)
    stale = rng.choice(args.n, int(args.stale * args.n), replace=False).astype(np.int64)
    moved, deleted = np.sort(stale[: len(stale) // 2]), np.sort(stale[len(stale) // 2 :])
    mirror = GpuMirror(copier=faiss.clone_index)
    mirror.sync(index, threading.Lock())
    legacy = faiss.clone_index(index)
    new = _unit(len(moved), args.dim, rng)
    for ids in (moved, deleted):  # the shard's apply: remove from both, then add the upserts
        index.remove_ids(faiss.IDSelectorArray(ids.size, faiss.swig_ptr(ids)))
        mirror.remove(ids)
    index.add_with_ids(new, moved)
    mirror.add(new, moved)
    legacy.add_with_ids(new, moved)
    clean = GpuMirror(copier=faiss.clone_index)
    clean.sync(index, threading.Lock())
    near = new[rng.choice(len(new), args.batch // 4, replace=False)]
    base = x[rng.choice(args.n, args.batch - len(near), replace=False)]
    q = np.concatenate([near, base]) + 0.05 * rng.standard_normal((args.batch, args.dim))
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    copies = _Copies(mirror, clean, legacy, index)
    rows = [_measure(args, k, q, copies) for k in args.k]
    return {
        "bench": "gpu_stale",
        "what": "a batch on the mirror with stale entries vs the same batch on a fresh copy "
        "(CPU clone standing in for the GPU copy), median of rounds; target ratio <= 1.2",
        "n": args.n,
        "dim": args.dim,
        "stale_share": args.stale,
        "batch": args.batch,
        "threads": faiss.omp_get_max_threads(),
        "machine": f"{platform.machine()}, {platform.python_version()}, faiss {faiss.__version__}",
        "results": rows,
        "max_ratio": max(r["ratio"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--stale", type=float, default=0.02)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--k", type=lambda s: [int(v) for v in s.split(",")], default=[10, 100])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = run(args)
    line = json.dumps(result)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(line)


if __name__ == "__main__":
    main()
