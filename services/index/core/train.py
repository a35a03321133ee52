"""Training: coarse quantizer + PQ codebooks (+ the SQ8 refine codec) from real embeddings.

The result is a *trained, empty* index that every shard starts from, written as
``<dir>/trained.faiss`` (the IVF-PQ index), ``<dir>/refine.faiss`` (an empty SQ8 index
that holds the trained scalar quantizer) and ``<dir>/manifest.json``
(:mod:`services.index.core.trained` reads them back). Adds encode into the existing lists
and codebooks; nothing is ever retrained in place.

The default nprobe is tuned (:func:`tune_nprobe`): the smallest nprobe whose 10-recall@10
*and* 100-recall@100 against exact search both reach ``target_recall`` (0.99) on vectors
held out of the training sample, measured through the shard's own search path (IVF-PQ
candidates re-ranked by SQ8). The wide recall stands in for real queries, which sit
farther from their neighbours than held-out corpus vectors (docs/index.md, Training).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from services.common.errors import InvalidArgument
from services.index.core.changes import Upsert
from services.index.core.shard import MAX_QUERIES, IvfPqShard
from services.index.core.trained import (
    GPU_PQ_M,
    REFINE,
    TRAINED,
    Manifest,
    TrainedIndex,
    gpu_pq_problem,
    pq_error,
)

log = logging.getLogger(__name__)

TARGET_RECALL = 0.99  # default 10-recall@10 and WIDE_K-recall@WIDE_K the tuned nprobe must reach
TUNE_K = 10
# Held-out corpus vectors are easier queries than real ones: their top 10 lie in fewer
# lists. Their top 100 spreads over as many lists as a real query's top 10 does. Measured
# (all-MiniLM-L6-v2; docs/index.md, Training): SciFact documents, nlist 132: 10-recall@10
# of held-out vectors reaches 0.99 at nprobe 48, where the 809 real claims get 0.984 (nDCG@10
# 0.6526 vs exact 0.6602); 100-recall@100 reaches 0.99 near nprobe 64, where the claims get
# 0.990. SciFact sentences, nlist 893: the 10@10 criterion already needs nprobe 316, where
# the claims get 0.990 or more: there the wide criterion costs little more.
WIDE_K = 100
TUNE_QUERIES = 1000  # held-out vectors at most (a tenth of the sample when it is smaller)
MIN_TUNE_QUERIES = 10  # fewer held-out vectors than this: no tuning, the old rule of thumb
# When no nprobe reaches the target, the PQ codes cap the recall, not the lists probed:
# the tuner takes the smallest nprobe within this much of the recall with every list
# probed (issue #33: a retrained generation got nprobe = nlist = 655, every list scanned on
# every search, for a recall a fraction of those lists already gave).
KNEE_RECALL = 0.005
# "IVF is the wrong choice": fewer vectors than FLAT_BELOW, or an exact flat search of the
# held-out queries measured at most FLAT_MARGIN times slower than the IVF-PQ path at the
# tuned nprobe. Measured here (384-d, one thread, batches of 256 queries, target 0.99;
# docs/index.md "Training"), flat vs IVF-PQ in ms per query: 2,000 SciFact sentences
# 0.040 vs 0.069, the 5,183 SciFact documents 0.077 vs 0.097, 10,000 sentences 0.29 vs
# 0.20, 20,000 0.94 vs 0.34, 49,951 2.64 vs 0.79. Both scale with dim (PQ has dim/4 bytes).
FLAT_BELOW = 10_000
FLAT_MARGIN = 1.5


@dataclass(frozen=True)
class TrainOptions:
    """Every knob of training; None = derived from the sample (see :func:`resolve`)."""

    nlist: int | None = None  # coarse centroids; default ≈ 4·√N, clamped
    pq_m: int | None = None  # PQ sub-quantizers; default: dim/4 rounded to a divisor
    pq_bits: int | None = None  # bits per PQ code; default 8, fewer for a small sample
    refine: bool = True  # SQ8 re-ranking of the IVF-PQ candidates (recall ≥ 0.95)
    refine_factor: int = 4  # candidates re-ranked = k · refine_factor
    nprobe: int | None = None  # default search nprobe; None: tuned to reach target_recall
    target_recall: float = TARGET_RECALL  # 10-recall@10 and 100-recall@100, held-out sample
    tune_queries: int = TUNE_QUERIES  # held-out vectors the tuning measures recall on
    max_train_points: int = 100_000
    seed: int = 1234
    model: str = "unknown"
    gpu: bool = False  # the shards will search on a GPU: PQ settings GPU IVF-PQ accepts


def default_nlist(n: int) -> int:
    """≈ 4·√N, at least 1, and at most N/39 so every centroid gets ~39 training points."""
    return max(1, min(int(4 * math.sqrt(n)), n // 39 or 1, 65536))


PQ_BITS = 8  # bits per PQ code: 256 centroids per sub-quantizer
MIN_TRAIN_VECTORS = 2  # the fewest a product quantizer trains on (1 bit: 2 centroids)


def default_pq_bits(n: int) -> int:
    """8 bits per code, or as many as ``n`` training vectors can train: each sub-quantizer
    has 2**bits centroids and k-means needs a vector per centroid (200 vectors: 7 bits,
    128 centroids; 0 below 2 vectors, which nothing can train). docs/index.md, Training."""
    return min(PQ_BITS, max(0, n.bit_length() - 1))


def inherited_pq_bits(bits: int, train_points: int) -> int | None:
    """A trained index's ``pq_bits`` for the next index trained in its place (a rollout):
    kept, or None (derived from the new sample) when they are fewer than 8 only because its
    sample was too small for 8 (``up`` on a 200-document corpus), so a grown corpus gets
    8-bit codes again."""
    if bits < PQ_BITS and bits == default_pq_bits(train_points):
        return None
    return bits


def default_pq_m(dim: int) -> int:
    """dim/4 sub-quantizers (1 byte per 4 dims at 8 bits), a divisor of dim.

    Measured on 49k SciFact sentences (384-d): with dim/8 (48 bytes) the PQ ranking of
    the candidates caps recall@10 near 0.95 even with the SQ8 refine; dim/4 (96 bytes)
    reaches 0.957 at nprobe 64 and 0.979 at nprobe 128 (docs/index.md).
    """
    target = max(1, dim // 4)
    for m in sorted(range(1, dim + 1), key=lambda c: (abs(c - target), -c)):
        if dim % m == 0:
            return m
    return 1


# A GPU pq_m with under a quarter of the default's sub-quantizers is refused rather than
# picked: a 1001-d index (7 x 11 x 13) has only pq_m 1 in GPU_PQ_M, one byte per vector.
# dim/8 already capped recall@10 near 0.95 with the refine (default_pq_m); 768-d keeps
# 96 (half of 192), 1024-d 64 (a quarter of 256).
MIN_GPU_PQ_SHARE = 4


def default_gpu_pq_m(dim: int) -> int | None:
    """The GPU-compatible pq_m closest to :func:`default_pq_m` (the larger on a tie), None
    when every one has under 1/:data:`MIN_GPU_PQ_SHARE` of its sub-quantizers."""
    target = default_pq_m(dim)
    fits = [
        m for m in GPU_PQ_M if gpu_pq_problem(dim, m, 8) is None and m * MIN_GPU_PQ_SHARE >= target
    ]
    return min(fits, key=lambda m: (abs(m - target), -m)) if fits else None


def resolve(options: TrainOptions, n: int, dim: int) -> TrainOptions:
    nlist = options.nlist or default_nlist(n)
    gpu_m = default_gpu_pq_m(dim) if options.gpu and not options.pq_m else None
    if options.gpu and not options.pq_m and gpu_m is None:
        raise InvalidArgument(
            f"--gpu: no pq_m GPU IVF-PQ accepts ({list(GPU_PQ_M)}, dividing {dim}) keeps a "
            f"quarter of the default {default_pq_m(dim)} sub-quantizers; give --pq-m"
        )
    pq_m = options.pq_m or gpu_m or default_pq_m(dim)
    if dim % pq_m:
        raise InvalidArgument(f"pq_m={pq_m} must divide the dimension {dim}")
    if nlist > n:
        raise InvalidArgument(f"nlist={nlist} needs at least as many training vectors ({n})")
    pq_bits = options.pq_bits or (PQ_BITS if options.gpu else default_pq_bits(n))
    if n < MIN_TRAIN_VECTORS:
        raise InvalidArgument(
            f"{n} training vector(s): product quantization needs at least {MIN_TRAIN_VECTORS}"
        )
    if 2**pq_bits > n:
        raise InvalidArgument(
            f"pq_bits={pq_bits} needs at least {2**pq_bits} training vectors (2**pq_bits "
            f"centroids per sub-quantizer), got {n}; lower pq_bits"
            + (" (GPU IVF-PQ takes only 8)" if options.gpu else "")
        )
    problem = gpu_pq_problem(dim, pq_m, pq_bits)
    if options.gpu and problem:
        raise InvalidArgument(f"--gpu: {problem}")
    if not 0.0 < options.target_recall <= 1.0:
        raise InvalidArgument(f"target recall {options.target_recall} must be in (0, 1]")
    if options.nprobe is not None and not 1 <= options.nprobe <= nlist:
        raise InvalidArgument(f"nprobe={options.nprobe} must be in 1..nlist ({nlist})")
    if problem:
        log.warning(
            "this index cannot be searched on a GPU (shards will use the CPU): %s; "
            "train with --gpu for GPU-compatible settings",
            problem,
        )
    return replace(options, nlist=nlist, pq_m=pq_m, pq_bits=pq_bits)


def rule_of_thumb_nprobe(nlist: int) -> int:
    """nlist/10, at least 32 (at most nlist): the default when the sample is too small to tune.

    On the 5,183 SciFact documents (nlist 132) it gave nprobe 32 and cost 0.019 of nDCG@10
    against exact search; the tuned nprobe is the default whenever tuning can run.
    """
    return max(1, min(nlist, max(32, round(nlist / 10))))


def check_vectors(x: np.ndarray, dim: int | None = None) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] == 0:
        raise InvalidArgument(f"expected a non-empty (n, dim) matrix, got shape {x.shape}")
    if dim is not None and x.shape[1] != dim:
        raise InvalidArgument(f"vectors have dimension {x.shape[1]}, the index has {dim}")
    if not np.isfinite(x).all():
        raise InvalidArgument("vectors contain NaN or Inf")
    return x


def train_index(vectors: np.ndarray, out_dir: Path, options: TrainOptions) -> Manifest:
    """Train on (a sample of) ``vectors`` and write the trained, empty index to ``out_dir``.

    Then tune the default nprobe on a held-out part of the sample (:func:`tune_nprobe`);
    an explicit ``options.nprobe`` is kept and its recall measured.
    """
    x = check_vectors(vectors)
    n, dim = x.shape
    rng = np.random.default_rng(options.seed)
    if n > options.max_train_points:
        x = x[rng.choice(n, options.max_train_points, replace=False)]
        n = len(x)
    opts = resolve(options, n, dim)
    assert opts.nlist and opts.pq_m and opts.pq_bits
    factory = f"IVF{opts.nlist},PQ{opts.pq_m}x{opts.pq_bits}"
    start = time.perf_counter()
    faiss.omp_set_num_threads(max(1, faiss.omp_get_max_threads()))
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.extract_index_ivf(index)
    ivf.cp.seed = opts.seed
    ivf.cp.min_points_per_centroid = 1  # small corpora: no warnings, defaults bounded above
    ivfpq: Any = faiss.downcast_index(ivf)
    ivfpq.pq.cp.min_points_per_centroid = 1
    ivfpq.pq.cp.niter = 15  # codebooks converge well before the default 25 iterations
    ivfpq.do_polysemous_training = False  # we never use Hamming filtering: minutes saved
    index.train(x)
    error = pq_error(index, x[: min(n, 10_000)])
    refine = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_8bit)
    refine.train(x)
    seconds = time.perf_counter() - start

    manifest = Manifest(
        dim=dim,
        metric="IP",
        factory=factory + (",Refine(SQ8)" if opts.refine else ""),
        model=opts.model,
        nlist=opts.nlist,
        pq_m=opts.pq_m,
        pq_bits=opts.pq_bits,
        refine=opts.refine,
        refine_factor=opts.refine_factor,
        nprobe=opts.nprobe or rule_of_thumb_nprobe(opts.nlist),
        train_points=n,
        train_pq_error=error,
        train_seconds=seconds,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        stats={"mean_norm": float(np.linalg.norm(x, axis=1).mean())},
        gpu_problem=gpu_pq_problem(dim, opts.pq_m, opts.pq_bits),
        gpu=opts.gpu,
    )
    tuning = tune_nprobe(TrainedIndex(manifest, index, refine), x, opts)
    _record_tuning(manifest, tuning)
    manifest.ivf_advice = ivf_advice(n, tuning)
    if manifest.ivf_advice:
        log.warning("%s", manifest.ivf_advice)
    ivf.nprobe = manifest.nprobe

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index, str(out / TRAINED))
    faiss.write_index(refine, str(out / REFINE))
    manifest.write(out)
    return manifest


def _record_tuning(manifest: Manifest, tuning: NprobeTuning | None) -> None:
    """``tuning``'s nprobe and measured recalls into ``manifest`` (the rule of thumb's
    nprobe kept, and said, when the sample was too small to tune)."""
    if tuning is None:
        log.warning(
            "%d training vectors are too few to tune nprobe: nprobe %d (nlist/10, at least 32)",
            manifest.train_points,
            manifest.nprobe,
        )
    else:
        manifest.nprobe = tuning.nprobe
        manifest.target_recall = tuning.target
        manifest.measured_recall = tuning.recall
        manifest.recall_by_nprobe = {str(p): r for p, r in sorted(tuning.tried.items())}
        manifest.wide_k = tuning.wide_k
        manifest.measured_wide_recall = tuning.wide_recall
        manifest.wide_recall_by_nprobe = {str(p): r for p, r in sorted(tuning.tried_wide.items())}
        manifest.tune_queries = tuning.queries
        manifest.tune_seconds = tuning.seconds
        manifest.flat_ms_per_query = tuning.flat_ms_per_query
        manifest.ivf_ms_per_query = tuning.ivf_ms_per_query
        if tuning.target is not None and min(tuning.recall, tuning.wide_recall) < tuning.target:
            nlist = max(tuning.tried)
            log.warning(
                "no nprobe reaches 10-recall@10 %.3f and %d-recall@%d %.3f: %.4f and "
                "%.4f with every list probed; the PQ codes cap it (raise --pq-m or "
                "--refine-factor, or lower --target-recall). nprobe %d of %d lists: the "
                "smallest within %.3f of that (10-recall@10 %.4f, %d-recall@%d %.4f); "
                "probing more lists costs more and finds no more",
                tuning.target,
                tuning.wide_k,
                tuning.wide_k,
                tuning.target,
                tuning.tried[nlist],
                tuning.tried_wide[nlist],
                tuning.nprobe,
                nlist,
                KNEE_RECALL,
                tuning.recall,
                tuning.wide_k,
                tuning.wide_k,
                tuning.wide_recall,
            )


@dataclass(frozen=True)
class NprobeTuning:
    nprobe: int
    recall: float  # 10-recall@10 at nprobe
    target: float | None  # None: nprobe was given, only its recall measured
    tried: dict[int, float]  # nprobe → recall, every candidate measured
    queries: int
    seconds: float
    flat_ms_per_query: float
    ivf_ms_per_query: float
    wide_k: int = 0  # k of the wide recall (0: not measured)
    wide_recall: float = 1.0  # wide_k-recall@wide_k at nprobe
    tried_wide: dict[int, float] = field(default_factory=dict)


def tune_nprobe(trained: TrainedIndex, x: np.ndarray, opts: TrainOptions) -> NprobeTuning | None:
    """The smallest nprobe whose 10-recall@10 and 100-recall@100 reach ``opts.target_recall``.

    None: too few vectors to tune.

    ``min(tune_queries, N/10)`` vectors of the sample ``x`` (seeded) are held out as
    queries and the rest is added to an :class:`IvfPqShard` of ``trained``, so a query is
    never its own neighbour and the recall is that of the search path a shard serves
    (IVF-PQ candidates, ``k × refine_factor`` of them, re-ranked by SQ8) against exact
    inner product search. Both recalls must reach the target: the 100-recall@100 of held-out
    vectors stands in for real queries (:data:`WIDE_K`; ``wide_k`` is smaller when fewer
    than 10·WIDE_K vectors remain). Candidates: 1, 2, 4, … until one reaches the target, then a
    binary search between the last two, so the nprobe just below the answer was measured
    and missed (recall is all but monotone in nprobe). When even nlist misses the target,
    the codes cap the recall: nprobe is the smallest within :data:`KNEE_RECALL` of the
    recall at nlist, found the same way (never nlist for no gain; the warning says so). The
    held-out vectors were part of k-means' sample: a slight optimism.
    """
    start = time.perf_counter()
    n, dim = x.shape
    nlist = trained.manifest.nlist
    held = min(opts.tune_queries, n // 10)
    if held < MIN_TUNE_QUERIES or n - held < TUNE_K:
        return None
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng(opts.seed).choice(n, held, replace=False)] = True
    queries, base = x[mask], x[~mask]

    shard = IvfPqShard(trained)
    for i in range(0, len(base), 10_000):
        rows = range(i, min(i + 10_000, len(base)))
        shard.apply([Upsert(str(j), base[j]) for j in rows], f"0-{rows.stop}")
    flat = faiss.IndexFlatIP(dim)
    flat.add(base)
    chunks = [queries[i : i + MAX_QUERIES] for i in range(0, held, MAX_QUERIES)]
    t = time.perf_counter()
    exact = np.concatenate([flat.search(q, TUNE_K)[1] for q in chunks])
    flat_ms = (time.perf_counter() - t) * 1000 / held
    wide_k = max(TUNE_K, min(WIDE_K, (n - held) // 10))
    exact_wide = np.concatenate([flat.search(q, wide_k)[1] for q in chunks])

    tried: dict[int, float] = {}
    tried_wide: dict[int, float] = {}
    ms: dict[int, float] = {}

    def measure(nprobe: int, k: int, truth: np.ndarray) -> float:
        found = [shard.search_top_k(q, k, nprobe).ids for q in chunks]
        ids = np.array([int(d) if d else -1 for row in found for d in row], dtype=np.int64)
        hits = (ids.reshape(held, k)[:, :, None] == truth[:, None, :]).any(axis=2)
        return float(hits.sum()) / (held * k)

    def recall(nprobe: int) -> float:
        """The lower of the two recalls at ``nprobe`` (both measured once)."""
        if nprobe not in tried:
            t = time.perf_counter()
            tried[nprobe] = measure(nprobe, TUNE_K, exact)
            ms[nprobe] = (time.perf_counter() - t) * 1000 / held
            tried_wide[nprobe] = measure(nprobe, wide_k, exact_wide)
        return min(tried[nprobe], tried_wide[nprobe])

    target: float | None = None
    if opts.nprobe:
        nprobe = opts.nprobe
        recall(nprobe)
    else:
        target = opts.target_recall
        missed, nprobe = 0, 1  # the largest candidate below the target; the next to try
        while recall(nprobe) < target and nprobe < nlist:
            missed, nprobe = nprobe, min(2 * nprobe, nlist)
        if recall(nprobe) < target:  # capped by the codes: the knee, not every list
            nprobe = _smallest_reaching(recall, max(0.0, recall(nlist) - KNEE_RECALL), nlist)
        else:
            nprobe = _smallest_reaching(recall, target, nprobe, missed)
    return NprobeTuning(
        nprobe=nprobe,
        recall=tried[nprobe],
        target=target,
        tried=tried,
        queries=held,
        seconds=time.perf_counter() - start,
        flat_ms_per_query=flat_ms,
        ivf_ms_per_query=ms[nprobe],
        wide_k=wide_k,
        wide_recall=tried_wide[nprobe],
        tried_wide=tried_wide,
    )


def _smallest_reaching(
    recall: Callable[[int], float], goal: float, reached: int, missed: int = 0
) -> int:
    """The smallest nprobe whose recall reaches ``goal``, knowing that ``reached`` does and
    ``missed`` (0: none) does not: the powers of two up to ``reached`` narrow it (when
    ``missed`` is not known), then a binary search between the two (recall is all but
    monotone in nprobe)."""
    if not missed:
        candidate = 1
        while candidate < reached and recall(candidate) < goal:
            missed, candidate = candidate, 2 * candidate
        reached = min(candidate, reached)
    while reached - missed > 1:
        mid = (missed + reached) // 2
        missed, reached = (missed, mid) if recall(mid) >= goal else (mid, reached)
    return reached


def ivf_advice(n: int, tuning: NprobeTuning | None) -> str | None:
    """Why a flat index would serve these ``n`` vectors better than IVF, or None.

    IVF pays for its coarse step and approximate codes only when it scans a small part of
    the index; below :data:`FLAT_BELOW` vectors (measured) an exact flat search is about as
    fast, and so it is when the tuning measured it so on this sample (:data:`FLAT_MARGIN`).
    """
    measured = ""
    if tuning is not None:
        measured = (
            f": on {tuning.queries} held-out vectors a flat search took "
            f"{tuning.flat_ms_per_query:.3f} ms per query, IVF-PQ at nprobe {tuning.nprobe} "
            f"{tuning.ivf_ms_per_query:.3f} ms for 10-recall@10 {tuning.recall:.3f}"
        )
        slow = tuning.flat_ms_per_query > FLAT_MARGIN * tuning.ivf_ms_per_query
        if n >= FLAT_BELOW and slow:
            return None
    elif n >= FLAT_BELOW:
        return None
    return (
        f"IVF is the wrong choice for {n} vectors{measured}. A flat index (IndexFlatIP) is "
        f"exact and about as fast below ~{FLAT_BELOW:,} vectors (docs/index.md, Training)"
    )
