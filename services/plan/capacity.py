"""The capacity arithmetic: from corpus size, query rate, encoder size, SLO, rerank depth
and replicas to shards, replicas, GPUs, CPU cores and memory.

Every :class:`Line` carries its value, the formula with the numbers put in, and the
sources of those numbers (a measured figure of :mod:`.measured`, a size profile of
:mod:`services.encoder.profiles`, or an input). The model of cost is deliberately plain:

- index bytes per vector scale with the PQ code (dim/4), the SQ8 refine code (dim) and
  the id (8) from the measured 384-d figure;
- a query's search CPU scales with the vectors it scans (nprobe × N / nlist, nlist the
  trainer's default ≈ 4·√N, nprobe the bench's) and with dim, from the bench's CPU per
  scanned vector; the bench's nprobe is assumed to hold its recall on the larger corpus
  (say so, and re-tune with ``index train``);
- shards: enough that one shard's search fits the SLO's search budget (SLO minus encoder,
  rerank and ``overhead_ms``) and the memory of one replica;
- replicas: enough cores (one search thread each) to serve the rate at ``utilisation``,
  at least ``min_replicas``;
- encoder: GTR on GPUs at its batch-1 latency (the GTR paper's figure; dynamic batching
  does better, so the GPU count is an upper bound); MiniLM on CPU at its measured rate.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument
from services.encoder.profiles import ModelProfile, get_profile
from services.index.core.train import default_nlist
from services.plan.measured import Measured
from services.plan.towers import tower_params

GIB = 1024**3


@dataclass(frozen=True)
class PlanInput:
    docs: int
    qps: float
    model: str = "base"  # an encoder size profile (base, large, xl, xxl, minilm)
    slo_ms: float = 100.0  # end-to-end latency target of a search
    rerank_depth: int = 0  # 0: no rerank
    min_replicas: int = 2  # per shard, for availability
    utilisation: float = 0.5  # busy share of a core / GPU at the planned rate (queueing)
    shard_memory_gib: float = 32.0  # memory of one shard replica's machine for the index
    memory_headroom: float = 1.5  # snapshots being written, id strings, the process
    overhead_ms: float = 10.0  # gateway, Redis fetch of the hits, network
    doc_bytes: int = 2000  # stored title + text + metadata per document (Redis)
    encoder_arch: str = "sde"  # `encoder train --arch`: asymmetric ones hold two towers
    gpu_shards: bool = False  # shards search on GPUs (the chart's index.gpu.enabled)

    def check(self) -> None:
        if self.docs < 1 or self.qps <= 0:
            raise InvalidArgument("docs must be >= 1 and qps > 0")
        if not 0 < self.utilisation <= 1:
            raise InvalidArgument("utilisation must be in (0, 1]")
        if self.slo_ms <= 0 or self.min_replicas < 1 or self.rerank_depth < 0:
            raise InvalidArgument("slo_ms > 0, min_replicas >= 1 and rerank_depth >= 0 needed")
        if self.shard_memory_gib <= 0 or self.memory_headroom < 1:
            raise InvalidArgument("shard_memory_gib > 0 and memory_headroom >= 1 needed")


@dataclass(frozen=True)
class Line:
    name: str
    value: float
    unit: str
    formula: str
    sources: tuple[str, ...] = ()


@dataclass
class Plan:
    lines: list[Line] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, name: str, value: float, unit: str, formula: str, *sources: str) -> float:
        self.lines.append(Line(name, value, unit, formula, sources))
        return value

    def __getitem__(self, name: str) -> float:
        for line in self.lines:
            if line.name == name:
                return line.value
        raise KeyError(name)


SNAPSHOTS_KEPT = 3  # ShardSettings.keep_snapshots' default
VOLUME_HEADROOM = 1.5


def index_bytes_per_vector(m: Measured, dim: int) -> float:
    """The measured bytes per vector scaled by (dim/4 + dim + 8) / (same at the bench's dim)."""
    d0 = m.index_dim.value
    return m.bytes_per_vector.value * (dim / 4 + dim + 8) / (d0 / 4 + d0 + 8)


def rerank_ms(m: Measured, depth: int) -> float:
    """ms per query at ``depth``: linear between measured depths, proportional outside."""
    points = sorted((d, f.value) for d, f in m.rerank_ms_at_depth.items())
    if depth <= 0:
        return 0.0
    if depth <= points[0][0]:
        return points[0][1] * depth / points[0][0]
    for (d0, v0), (d1, v1) in itertools.pairwise(points):
        if depth <= d1:
            return v0 + (v1 - v0) * (depth - d0) / (d1 - d0)
    d_last, v_last = points[-1]
    return v_last * depth / d_last


@dataclass(frozen=True)
class _Case:
    """What every section of a plan reads: the inputs, the measurements, the size profile.
    A section reads the figures of the sections before it from the plan's lines."""

    inp: PlanInput
    m: Measured
    prof: ModelProfile

    @property
    def profile_source(self) -> str:
        return f"services/encoder/profiles.py: {self.prof.name} ({self.prof.slo_source})"


def plan(inp: PlanInput, m: Measured) -> Plan:
    """The lines of a deployment's plan, section by section (see the module docstring)."""
    inp.check()
    case = _Case(inp, m, get_profile(inp.model))
    out = Plan()
    for section in (
        _index_memory,
        _latency_budget,
        _shards,
        _replicas,
        _text_index,
        _encoder,
        _rerank_gateway_redis,
    ):
        section(out, case)
    cores = sum(out[n] for n in ("index cores", "encoder cores", "rerank cores", "gateway cores"))
    out.add("CPU cores, total", cores, "cores", "index + encoder + rerank + gateway")
    return out


def _index_memory(out: Plan, case: _Case) -> None:
    """The index's bytes per vector and its memory, one copy."""
    inp, m, prof = case.inp, case.m, case.prof
    dim = prof.dim
    src_prof = case.profile_source
    bpv = out.add(
        "index bytes per vector",
        index_bytes_per_vector(m, dim),
        "B",
        f"{m.bytes_per_vector.value:.0f} × ({dim}/4 + {dim} + 8) / "
        f"({m.index_dim.value:.0f}/4 + {m.index_dim.value:.0f} + 8)",
        m.bytes_per_vector.source,
        src_prof,
    )
    out.add(
        "index memory, one copy",
        inp.docs * bpv * inp.memory_headroom / GIB,
        "GiB",
        f"{inp.docs:,} × {bpv:.0f} B × headroom {inp.memory_headroom}",
        "input: docs",
    )


def _latency_budget(out: Plan, case: _Case) -> None:
    """The encoder's and the rerank's latency, and what the SLO leaves the search."""
    inp, m, prof = case.inp, case.m, case.prof
    src_prof = case.profile_source
    if prof.name == "minilm":
        enc_ms = out.add(
            "encoder latency",
            m.cpu_encoder_p99_ms.value,
            "ms",
            "measured p99 on CPU (Triton, concurrency 1)",
            m.cpu_encoder_p99_ms.source,
        )
    else:
        enc_ms = out.add(
            "encoder latency",
            prof.slo_ms,
            "ms",
            "batch-1 latency of the size profile (GPU)",
            src_prof,
        )
    rr_ms = out.add(
        "rerank latency",
        rerank_ms(m, inp.rerank_depth),
        "ms",
        f"depth {inp.rerank_depth} on {m.rerank_threads.value:.0f} CPU threads, "
        "interpolated between measured depths",
        *(f.source for f in m.rerank_ms_at_depth.values()),
    )
    budget = out.add(
        "search budget",
        inp.slo_ms - enc_ms - rr_ms - inp.overhead_ms,
        "ms",
        f"SLO {inp.slo_ms:g} − encoder {enc_ms:.1f} − rerank {rr_ms:.1f} − overhead "
        f"{inp.overhead_ms:g}",
        "inputs: slo_ms, overhead_ms",
    )
    if budget <= 0:
        raise InvalidArgument(
            f"the SLO of {inp.slo_ms:g} ms leaves no time for the search (encoder "
            f"{enc_ms:.1f} ms, rerank {rr_ms:.1f} ms, overhead {inp.overhead_ms:g} ms): raise "
            "the SLO, lower the rerank depth or choose a smaller encoder"
        )
    if rr_ms > 0.5 * inp.slo_ms:
        out.warnings.append(
            f"rerank at depth {inp.rerank_depth} takes {rr_ms:.0f} ms on CPU, over half the "
            "SLO: serve it on a GPU (not measured here) or lower the depth"
        )


def _shards(out: Plan, case: _Case) -> None:
    """The search CPU per query over the whole corpus, and the shards it and the memory need."""
    inp, m, prof = case.inp, case.m, case.prof
    dim = prof.dim
    budget = out["search budget"]
    index_gib = out["index memory, one copy"]
    # one trained index for all shards: nlist = default_nlist(docs); a query scans
    # nprobe/nlist of every shard, i.e. nprobe × docs / nlist vectors in all
    nlist = default_nlist(inp.docs)
    nprobe = max(1, min(nlist, round(m.index_nprobe_share.value * m.index_nlist.value)))
    scanned_bench = m.index_vectors.value * m.index_nprobe_share.value
    scanned = nprobe * inp.docs / nlist
    us_per_scanned = m.shard_cpu_us_per_query.value / scanned_bench
    search_us = out.add(
        "search CPU per query, whole corpus",
        us_per_scanned * scanned * dim / m.index_dim.value,
        "µs",
        f"{m.shard_cpu_us_per_query.value:.0f} µs / {scanned_bench:,.0f} vectors scanned × "
        f"{scanned:,.0f} scanned (nprobe {nprobe} × {inp.docs:,} / nlist {nlist}) × "
        f"{dim}/{m.index_dim.value:.0f}",
        m.shard_cpu_us_per_query.source,
        m.index_vectors.source,
        m.index_nprobe_share.source,
        "assumed: the bench's nprobe holds its recall at nlist ≈ 4·√N (re-tune with `index "
        "train` on a sample of the real corpus)",
    )
    by_latency = math.ceil(search_us / 1000 / budget)
    by_memory = math.ceil(index_gib / inp.shard_memory_gib)
    out.add(
        "shards",
        max(1, by_latency, by_memory),
        "",
        f"max(⌈{search_us / 1000:.2f} ms / {budget:.1f} ms⌉ = {by_latency} for latency, "
        f"⌈{index_gib:.2f} GiB / {inp.shard_memory_gib:g} GiB⌉ = {by_memory} for memory)",
        "inputs: shard_memory_gib",
    )


def _replicas(out: Plan, case: _Case) -> None:
    """The replicas per shard the query rate needs, their cores and memory."""
    inp = case.inp
    util = inp.utilisation
    search_us = out["search CPU per query, whole corpus"]
    shards = int(out["shards"])
    index_gib = out["index memory, one copy"]
    shard_us = search_us / shards
    replicas_cpu = math.ceil(inp.qps * shard_us * 1e-6 / util)
    replicas = int(
        out.add(
            "replicas per shard",
            max(inp.min_replicas, replicas_cpu),
            "",
            f"max(min {inp.min_replicas}, ⌈{inp.qps:g} q/s × {shard_us:.0f} µs / {util}⌉ = "
            f"{replicas_cpu}), one search core each",
            "inputs: qps, min_replicas, utilisation",
        )
    )
    out.add("index cores", shards * replicas, "cores", f"{shards} × {replicas}")
    if inp.gpu_shards:
        gpus = out.add(
            "index GPUs (GPU shards)",
            shards * replicas,
            "GPUs",
            f"{shards} × {replicas}: a whole GPU per shard replica (each pod requests one "
            "nvidia.com/gpu, which the device plugin does not share; the copy holds the "
            "replica's PQ codes and float16 tables)",
            "deploy/k8s/gtr-retrieval/templates/index.yaml",
        )
        out.add(
            "index GPUs during a rollout",
            2 * gpus,
            "GPUs",
            f"2 × {gpus:g}: the new generation's shards (as many, at the same shard count) "
            "run beside the serving ones from the train phase until the previous "
            "generation is retired",
            "docs/generations.md",
        )
    out.add(
        "index memory per replica",
        index_gib / shards,
        "GiB",
        f"{index_gib:.2f} GiB / {shards} shards",
    )
    out.add(
        "index memory, all replicas",
        index_gib * replicas,
        "GiB",
        f"{index_gib:.2f} GiB × {replicas} replicas",
    )


def _text_index(out: Plan, case: _Case) -> None:
    """The BM25 text index's disk and the shard volume (when it was measured)."""
    inp, m = case.inp, case.m
    bpv = out["index bytes per vector"]
    shards = int(out["shards"])
    if m.text_bytes_per_doc is not None and m.text_doc_bytes is not None:
        text_bpd = out.add(
            "text index bytes per document",
            m.text_bytes_per_doc.value * inp.doc_bytes / m.text_doc_bytes.value,
            "B",
            f"{m.text_bytes_per_doc.value:.0f} B measured on documents of "
            f"{m.text_doc_bytes.value:.0f} B × doc_bytes {inp.doc_bytes} / "
            f"{m.text_doc_bytes.value:.0f} (a BM25 index grows with the text)",
            m.text_bytes_per_doc.source,
            m.text_doc_bytes.source,
            "input: doc_bytes",
        )
        text_gib = out.add(
            "text index disk per replica",
            inp.docs * text_bpd / shards / GIB,
            "GiB",
            f"{inp.docs:,} × {text_bpd:.0f} B / {shards} shards (Tantivy segments, mmapped)",
        )
        vectors_gib = inp.docs * bpv / shards / GIB
        out.add(
            "shard volume per replica",
            (SNAPSHOTS_KEPT * (vectors_gib + text_gib) + text_gib) * VOLUME_HEADROOM,
            "GiB",
            f"({SNAPSHOTS_KEPT} snapshots × ({vectors_gib:.2f} GiB vectors + {text_gib:.2f} "
            f"GiB text) + {text_gib:.2f} GiB live text index) × {VOLUME_HEADROOM} (a snapshot "
            "being written)",
            "services/index/server/settings.py: keep_snapshots",
        )


def _encoder(out: Plan, case: _Case) -> None:
    """The encoder's GPUs or cores, and the weights of one instance."""
    inp, m, prof = case.inp, case.m, case.prof
    util = inp.utilisation
    src_prof = case.profile_source
    if prof.name == "minilm":
        per_core = m.cpu_encoder_texts_per_s.value / m.cpu_encoder_cores.value
        out.add("encoder GPUs", 0, "GPUs", "MiniLM runs on CPU")
        out.add(
            "encoder cores",
            math.ceil(inp.qps / (per_core * util)),
            "cores",
            f"⌈{inp.qps:g} q/s / ({m.cpu_encoder_texts_per_s.value:.0f} texts/s / "
            f"{m.cpu_encoder_cores.value:.0f} cores × {util})⌉",
            m.cpu_encoder_texts_per_s.source,
        )
    else:
        per_gpu = prof.triton_instances * 1000 / prof.slo_ms
        out.add(
            "encoder GPUs",
            math.ceil(inp.qps / (per_gpu * util)),
            "GPUs",
            f"⌈{inp.qps:g} q/s / ({prof.triton_instances} instances × 1000 / "
            f"{prof.slo_ms:g} ms × {util})⌉ on {prof.gpu}; batch 1, so an upper bound",
            src_prof,
        )
        out.add("encoder cores", 0, "cores", "on the GPU")
    params = tower_params(prof, inp.encoder_arch)
    width = 4 if prof.name == "minilm" else 2  # FP32 ONNX on CPU, FP16 plan on GPU
    out.add(
        "encoder weights per instance",
        params * width / GIB,
        "GiB",
        f"{params / 1e6:,.1f} M parameters ({inp.encoder_arch}: "
        f"{params / tower_params(prof, 'sde'):.2f}× SDE) × {width} B",
        "services/plan/towers.py",
    )


def _rerank_gateway_redis(out: Plan, case: _Case) -> None:
    """The rerank's and the gateway's cores, and Redis's memory."""
    inp, m = case.inp, case.m
    util = inp.utilisation
    rr_ms = out["rerank latency"]
    threads = m.rerank_threads.value
    out.add(
        "rerank cores",
        math.ceil(inp.qps * rr_ms / 1000 * threads / util),
        "cores",
        f"⌈{inp.qps:g} q/s × {rr_ms:.0f} ms × {threads:.0f} threads / {util}⌉ (CPU)",
        m.rerank_threads.source,
    )
    out.add(
        "gateway cores",
        max(1, math.ceil(inp.qps * m.router_cpu_us_per_query.value * 1e-6 / util)),
        "cores",
        f"⌈{inp.qps:g} q/s × {m.router_cpu_us_per_query.value:.0f} µs / {util}⌉ (router and "
        "merge; the bench's client shares it)",
        m.router_cpu_us_per_query.source,
    )
    out.add(
        "redis memory",
        inp.docs * inp.doc_bytes * 2 / GIB,
        "GiB",
        f"{inp.docs:,} docs × {inp.doc_bytes} B × 2 (hash and allocator overhead, assumed)",
        "input: doc_bytes",
    )
