"""Rollout benchmark (issue #24): how fast ``index rollout --encoder`` re-embeds the stored
documents, and what it does to the searches served meanwhile.

``gtr-retrieval up`` runs as a user runs it (Redis, Triton's CPU repository, 2 shards,
the gateway; no reranker) on the first ``--docs`` SciFact documents. Searches
(``--searches-per-s``, open loop) and upserts + deletes (``--writes-per-s``) go through
the gateway for ``--before-s`` seconds, then on while ``index rollout --encoder <second
encoder>`` runs to its switch. Figures (human-readable lines, then one JSON line last;
``bench/results/rollout.json`` keeps it):

* ``reembed_docs_per_s``: documents the builder appended in its bulk phase (the target's
  ``lv`` hashes) ÷ the seconds it spent there (both polled from ``{gtr}:rollout`` every
  100 ms), re-embedded through Triton with the new model version while the searches go on
  (``--sample`` documents are encoded in the train phase before it, not counted);
* ``inprocess_docs_per_s``: the same documents' texts encoded in this process by the same
  model (its ONNX export, ONNX Runtime, batches of ``--batch``, run one document per
  graph run when its documents are int8) on the CPUs the rollout is
  given (``--cpus``), with as many threads: the same compute, so the ratio measures the
  re-embedding pipeline (Redis, Triton, the appends), not the budget; measured before and
  after the rollout in the same run (the mean). ``inprocess_every_cpu_docs_per_s``: the
  same on every CPU, for the record;
* ``reembed_ratio`` = the first ÷ the second (goal ≥ 0.8);
* ``p99_before_ms``, ``p99_during_ms``: search latency p99 (client side) in the window
  before the rollout (``--before-s``, 90 s: at 20 searches/s a 30-s window's p99 was its
  6th slowest search, and read 18.8-24.3 ms in four runs of one code) and from its start
  to its switch; ``p99_during_over_before`` (goal ≤ 1.5) and its 95 % interval,
  ``p99_during_over_before_ci95`` (a block bootstrap over 2-s blocks of searches,
  ``bench/p99_interval.py``); failed searches in each window;
* where the time goes: ``p99_by_phase_ms`` (search p99 of the searches started in each
  builder phase), ``stage_p99_ms`` (the gateway's own stage timings, ``encode``,
  ``search``, ``fetch``, ``total``, before and during), a 2-s timeline printed above
  (the searches, then the cores each process role used: which process woke up when a
  window turned slow), ``cpu_budget_log``: what ``up`` said of the budget's split
  (serving moved onto every CPU when its measured load outgrew the CPUs left to it, and
  back), and ``switch_searches``: the switch phase search by search (its ~25 searches are too few
  for a p99 to say where the time went), with when the load saw the alias move and the
  writes that ended in it.

* the writes (issue #33 point 2): ``writes_per_s`` (acknowledged during the rollout,
  measured; ``writes_per_s_asked`` the load's rate), ``catch_up_entries_per_s`` (entries
  the builder replayed in its catch_up phase ÷ its seconds), ``entries_with_target_vectors``
  of ``upsert_entries_since_p0`` (the gateway's dual write; ``dual_encodes``: its
  counter of them by outcome: encoded with the write, late (kept beside its entry after
  the write, for the catch-up) or failed), and ``lost_writes``: the
  acknowledged writes after P0 whose id and version the new generation does not hold
  (``bench/rollout_writes.py``; ``writes_checked`` of them).

* ``cpu_cores``: the cores each process role used before the rollout and during it
  (``bench/cpu_roles.py``: the client, the gateway, each generation's shards, each encoder
  version's Triton stub, Redis, the builder), the whole machine's busy cores and ``other``
  (what the rest of the machine used: a run beside another job says so here).

``--document-precision`` (default int8, as ``up`` serves): the stack's documents and the
new encoder's (exported with int8 queries and documents, its gates measured on SciFact,
and rolled out as that export folder); ``fp32`` for both FP32. Kept as
``document_precision``.

``--retrain`` rolls out ``index rollout --retrain`` instead (no in-process baseline;
``bench/results/rollout_retrain_writes.json``).

The phase watcher polls Redis from a process of its own: polling from a thread of this
process took the GIL from the load generator's event loop during the rollout only.

Usage: ``python -m bench.rollout [--docs 1500] [--before-s 90] [--encoder DIR | --retrain]
[--writes-per-s 5] [--cpus last|LIST|none] [--redis-fsync always|everysec]``
(``--redis-fsync``: ``up``'s, kept as ``redis_fsync``). Server, builder and client share this
machine's cores: the figures are for a CPU-only machine where the rollout competes
with serving. ``--cpus`` (default: the
last CPU) is passed to ``index rollout --cpus`` (docs/generations.md "A rollout's CPU
budget"); this process, the load generator, keeps off those CPUs once the stack runs (it
stands in for callers on other machines). ``--cpus none``: no budget.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.cpu_roles import RoleCpu
from bench.p99_interval import p99_ratio_interval
from bench.rollout_writes import check_writes, dual_counts, dual_encode_outcomes, hold_source
from services.cli.generation_commands import PACE
from services.process import cpus as cpu_sets

SHARED = Path(
    os.environ.get("GTR_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data")
)
SCIFACT = SHARED / "scifact"


def _texts(corpus: Path) -> list[str]:
    from services.common.domain import Document

    out = []
    with corpus.open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            out.append(Document(row["_id"], row["text"], row.get("title", "")).embedding_text)
    return out


def inprocess_docs_per_s(onnx_path: Path, texts: list[str], batch: int, threads: int) -> float:
    """Documents/s of the model in this process (ONNX Runtime), document side, in batches."""
    from services.encoder.runtime.onnx_embedder import OnnxEmbedder

    embedder = OnnxEmbedder(onnx_path, threads=threads)
    embedder.embed(texts[:batch], "document")  # warm up
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        embedder.embed(texts[i : i + batch], "document")
    return len(texts) / (time.perf_counter() - start)


def int8_export(encoder: Path, onnx_path: Path, gate: bool) -> dict[str, Any]:
    """The new encoder exported as ``up`` serves the default model: int8 queries and
    documents (``model.int8.onnx``). With ``gate`` (``--int8-gate``) gated on SciFact as
    ``encoder export`` gates it (minutes: the corpus through both graphs); when the
    quality gate refuses it (the bench's perturbed MiniLM: dev nDCG@10 0.6312 → 0.6252
    with int8 queries, 2026-11-30), or without ``gate``, the same graphs are made with the
    parity gates only, and the result says so: this bench measures what a rollout's
    encoding costs, and the perturbed encoder's quality is not what it measures."""
    from dataclasses import replace

    from services.common.errors import FailedPrecondition
    from services.encoder.build.document_int8 import (
        DOCUMENT_PARITY_MIN_COSINE,
        document_parity_cosines,
    )
    from services.encoder.build.export import INT8_ONNX, EncoderMeta, export_onnx
    from services.encoder.build.query_int8 import (
        check_int8_parity,
        export_with_int8_query,
        quantize_query_graph,
    )

    refused = "not run (--int8-gate runs it)"
    if gate:
        print("exporting the new encoder with int8 queries and documents (gated on SciFact)")
        try:
            export_with_int8_query(encoder, onnx_path, SCIFACT, documents=True)
            _record_parity(encoder, onnx_path)
            return {"gated": True}
        except FailedPrecondition as exc:
            refused = str(exc)
    print(f"quality gate: {refused}; int8 graphs with the parity gates only (a bench encoder)")
    export_onnx(encoder, onnx_path)
    int8 = onnx_path.parent / INT8_ONNX
    quantize_query_graph(onnx_path, int8)
    queries, problem = check_int8_parity(onnx_path, int8)
    documents = document_parity_cosines(onnx_path, int8)
    if problem or not float(documents.min()) >= DOCUMENT_PARITY_MIN_COSINE:
        raise SystemExit(f"the new encoder's int8 graph fails parity: {problem or documents}")
    meta = EncoderMeta.read(onnx_path.parent)
    towers = {"query": INT8_ONNX, "document": INT8_ONNX}
    meta = replace(meta, towers=towers, query_precision="int8", document_precision="int8")
    meta.write(onnx_path.parent)
    _record_parity(encoder, onnx_path)
    return {
        "gated": False,
        "quality_gate": refused,
        "parity_min_cosine": {
            "queries": round(float(queries.min()), 4),
            "documents": round(float(documents.min()), 4),
        },
    }


def _record_parity(encoder: Path, onnx_path: Path) -> None:
    """The parity check ``encoder export`` runs, and records, after an export: the
    rollout's publish then takes the record instead of loading the checkpoint in PyTorch
    on the rollout's CPU (``services/encoder/build/parity_record.py``)."""
    from services.encoder.build import parity_record
    from services.encoder.build.export import check_parity

    report = check_parity(encoder, onnx_path)
    if parity_record.write(encoder, onnx_path, report) is None:
        raise SystemExit(f"the new encoder's export fails parity: {report.summary()}")


def steady_load(
    stack: Any, searches_per_s: float, writes_per_s: float, budget: frozenset[int] | None
) -> Any:
    """The load of the rollout benches (SciFact's queries, upserts and deletes of their
    own documents), from this process, kept off a rollout's CPU ``budget``: the client
    stands in for callers on other machines."""
    from tests.support.local_stack import queries
    from tests.support.steady_load import SteadyLoad

    if budget:
        cpu_sets.pin_process(os.getpid(), cpu_sets.available() - budget)
    return SteadyLoad(
        stack.gateway,
        queries(SCIFACT),
        searches_per_s=searches_per_s,
        writes_per_s=writes_per_s,
        redis_url=stack.redis_url,
        prefix="bench",
    )


@contextlib.contextmanager
def loaded_stack(
    args: argparse.Namespace,
    budget: frozenset[int] | None,
    prefix: str,
    extra: Sequence[str] = (),
    up_log: Path | None = None,
) -> Iterator[tuple[Any, Any, Path, Path]]:
    """The stack of the benches that share :func:`add_stack_arguments` (``bench.rollout_rounds``,
    ``bench.busy_budget``): ``args.docs`` SciFact documents on 2 shards, int8 documents (as
    ``up`` serves), ``extra`` more flags for ``up``, and its :func:`steady_load` (not started):
    (stack, load, a temporary folder, the run dir)."""
    from tests.support.local_stack import local_stack, small_corpus

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp_name:
        tmp = Path(tmp_name)
        corpus = tmp / "corpus.jsonl"
        small_corpus(SCIFACT, corpus, args.docs, args.text_chars)
        run_dir = args.run_dir or tmp / "run"
        flags = ["--document-precision", "int8", "--triton-nice", str(args.triton_nice), *extra]
        log = up_log or tmp / "up.log"
        with local_stack(run_dir, log, corpus=corpus, shards=2, extra=flags) as stack:
            load = steady_load(stack, args.searches_per_s, args.writes_per_s, budget)
            yield stack, load, tmp, run_dir


def under_load(load: Any, before_s: float, rounds: Callable[[], Awaitable[None]]) -> float:
    """Run ``load`` (:func:`steady_load`) for ``before_s`` seconds, then ``rounds()`` under
    it, then stop it (``bench.rollout_rounds``, ``bench.busy_budget``): the monotonic time
    the rounds began, the end of the window before."""

    async def scenario() -> float:
        runner = asyncio.ensure_future(load.run())
        try:
            await asyncio.sleep(before_s)
            first = time.monotonic()
            await rounds()
        finally:
            load.stop()
            await runner
        return first

    return asyncio.run(scenario())


def add_stack_arguments(parser: argparse.ArgumentParser, *, docs: int, writes_per_s: float) -> None:
    """The rollout benches' stack, load and budget flags (their defaults: ``docs`` stored,
    ``writes_per_s``)."""
    parser.add_argument("--docs", type=int, default=docs, help=f"SciFact documents stored ({docs})")
    parser.add_argument("--text-chars", type=int, default=1000, help="text cut to (1000)")
    parser.add_argument("--searches-per-s", type=float, default=20.0)
    parser.add_argument("--writes-per-s", type=float, default=writes_per_s)
    parser.add_argument("--before-s", type=float, default=90.0, help="window before (90 s)")
    parser.add_argument(
        "--cpus",
        default="last",
        help="the rollout's CPU budget (`index rollout --cpus`): 'last' (default: the "
        "last CPU of this machine), a CPU list, or 'none' (no budget: every process on "
        "every CPU)",
    )
    parser.add_argument("--run-dir", type=Path, help="keep the stack's run dir here")
    parser.add_argument(
        "--triton-nice",
        type=int,
        default=10,
        help="`up --triton-nice`: Triton's session nice (10, up's default; 0 to compare)",
    )


def rollout_budget(spec: str, machine: frozenset[int]) -> frozenset[int] | None:
    """The rollout's CPU budget of ``--cpus``: None for 'none' or a one-CPU machine, the
    last CPU for 'last', else the list given (both rollout benches)."""
    if spec == "none" or len(machine) < 2:
        return None
    return frozenset({max(machine)}) if spec == "last" else cpu_sets.budget_for(spec, machine)


def _inprocess_on(
    cpus: frozenset[int] | None, onnx_path: Path, texts: list[str], batch: int, threads: int
) -> float:
    """:func:`inprocess_docs_per_s` with this process pinned to ``cpus`` meanwhile."""
    before = cpu_sets.available()
    if cpus:
        cpu_sets.pin_process(os.getpid(), cpus)
    try:
        return inprocess_docs_per_s(onnx_path, texts, batch, threads)
    finally:
        cpu_sets.pin_process(os.getpid(), before)


def p99(latencies: list[float]) -> float:
    return float(np.percentile(np.asarray(latencies), 99)) if latencies else float("nan")


def start_s(marks: dict[str, float], load: Any) -> float:
    return marks["rollout_start"] - load.record.started


def p99_by_phase(searches: list[Any], marks: dict[str, float], end: float) -> dict[str, Any]:
    """Search p99 (ms) and count of the OK searches that started in each builder phase:
    where in the rollout the latency goes."""
    starts = sorted(
        (v, k.removeprefix("phase_")) for k, v in marks.items() if k.startswith("phase_")
    )
    out: dict[str, Any] = {}
    for n, (begin, phase) in enumerate(starts):
        stop = starts[n + 1][0] if n + 1 < len(starts) else end
        ok = [s for s in searches if begin <= s.start < stop and s.code == "OK"]
        out[phase] = {
            "p99_ms": round(1e3 * p99([s.latency for s in ok]), 1) if ok else None,
            "searches": len(ok),
        }
        timed = [s for s in ok if s.stages]
        if timed:  # the gateway's stage p99s in this phase
            out[phase]["stages"] = {
                name: round(float(np.percentile([s.stages[name] for s in timed], 99)), 1)
                for name in ("encode", "search", "fetch", "total")
            }
    return out


def switch_searches(record: Any, marks: dict[str, float], end: float) -> dict[str, Any]:
    """The switch phase search by search (too few for a p99 to say where): each OK one's
    start (s from the phase's start), latency and the gateway's stages and total (ms), and the
    generation that answered; with when the load saw the alias change."""
    begin = marks.get("phase_switch")
    if begin is None:
        return {}
    rows = [
        [
            round(s.start - begin, 3),
            round(1e3 * s.latency, 1),
            s.generation,
            *(
                round(s.stages.get(k, float("nan")), 1)
                for k in ("encode", "search", "fetch", "total")
            ),
        ]
        for s in record.searches
        if begin <= s.start < end and s.code == "OK"
    ]
    moved = [round(a.at - begin, 3) for a in record.aliases if begin <= a.at < end]
    # the writes that ended in the phase: the ones the closed gates held are re-encoded
    # with the new encoder at the switch, on the Triton version g2's searches use
    writes = [
        [round(w.start - begin, 3), round(1e3 * (w.end - w.start), 1), w.kind, w.code, w.generation]
        for w in record.writes
        if w.end and begin <= w.end < end
    ]
    return {
        # total: the gateway's own time for the search (its stages and what is between
        # them); the rest of "ms" is outside the gateway's handler (the transport, the
        # load generator, a gateway loop busy before the handler began)
        "columns": ["start_s", "ms", "generation", "encode", "search", "fetch", "total"],
        "rows": rows,
        "alias_changed_s": moved,
        "write_columns": ["start_s", "ms", "kind", "code", "generation"],
        "writes": writes,
    }


POLL_S = 0.1  # the phase watcher's poll


def _watch_phases(redis_url: str, stop: Any, ready: Any, out: Any) -> None:
    """PhaseWatch's poller, in a process of its own: polling Redis every 20 ms from a
    thread of the load generator's process took the GIL from its event loop and showed as
    search latency during the rollout only. Every 100 ms since 2026-11-30: at 20 ms the
    bench's own processes read 0.10 cores before the rollout and 0.13 during it (this
    poller parses the rollout's state 50 times a second once there is one, each a Redis
    round trip and two wake-ups on the machine under test); phases last seconds."""
    import redis

    from services.generations.registry import Registry
    from services.index.keys import ADDRESSES_KEY

    client = redis.Redis.from_url(redis_url)
    reg = Registry(client)
    seen: dict[str, float] = {}
    bulk_appended, bulk_first = 0, None
    replayed: dict[str, int] = {}  # entries replayed when each phase was first seen
    names: dict[str, Any] = {}
    while not stop.is_set():
        state = reg.running()
        phase = state.phase if state is not None else None
        if phase:
            seen.setdefault(phase, time.monotonic())  # CLOCK_MONOTONIC: one for all processes
        if state is not None and state.p0:
            names = {"source": state.source, "target": state.target, "p0": state.p0}
        target = state.target if state is not None else ""
        if target and "published" not in seen and client.hexists(ADDRESSES_KEY, target):
            seen["published"] = time.monotonic()  # the target's shards started
        if state is not None and phase:
            replayed.setdefault(phase, sum(state.replayed.values()))
        if state is not None and phase == "bulk" and state.target:
            keys = reg.keys(reg.get(state.target))
            appended = sum(int(client.hlen(keys.logged(s))) for s in range(keys.num_shards))
            if bulk_first is None:
                bulk_first = appended
            bulk_appended = max(bulk_appended, appended)
        ready.set()
        time.sleep(POLL_S)
    out.put(
        {
            "seen": seen,
            "bulk_appended": bulk_appended,
            "bulk_first": bulk_first,
            "replayed": replayed,
            "names": names,
        }
    )


class PhaseWatch:
    """The builder's phase as ``{gtr}:rollout`` says it, polled every 100 ms by a process of
    its own: when each phase was first seen, and the documents appended in the bulk phase."""

    def __init__(self, redis_url: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._stop, self._ready = ctx.Event(), ctx.Event()
        self._out: Any = ctx.Queue()
        self._proc = ctx.Process(
            target=_watch_phases, args=(redis_url, self._stop, self._ready, self._out)
        )
        self.seen: dict[str, float] = {}
        self.bulk_appended = 0  # documents in the target's lv hashes while in bulk
        self.bulk_first: int | None = None  # ...when the bulk phase was first seen
        self.replayed: dict[str, int] = {}  # entries replayed when each phase was first seen
        self.names: dict[str, Any] = {}  # source, target, p0

    def __enter__(self) -> PhaseWatch:
        """Once the watcher polls: its process's start (an interpreter, redis-py) is
        not the rollout's, and a window begun after this does not hold it. Entered
        again (``with`` after a first call), it returns at once."""
        if self._proc.is_alive() or self._ready.is_set():
            return self
        self._proc.start()
        if not self._ready.wait(60):
            self._proc.kill()
            raise RuntimeError("the phase watcher did not start polling within 60 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        result = self._out.get(timeout=30)
        self._proc.join(10)
        self.seen = result["seen"]
        self.bulk_appended = result["bulk_appended"]
        self.bulk_first = result["bulk_first"]
        self.replayed = result["replayed"]
        self.names = result["names"]

    def phases(self) -> dict[str, float]:
        """When each builder phase was first seen (``seen`` without ``published``: when
        the target's shard addresses were)."""
        return {k: v for k, v in self.seen.items() if k != "published"}

    def catch_up_rate(self) -> tuple[float, int, float]:
        """(entries/s, entries, seconds) the builder replayed in its catch_up phase: from
        its first sighting to the switch phase's."""
        if "catch_up" not in self.seen or "switch" not in self.seen:
            return float("nan"), 0, float("nan")
        n = self.replayed["switch"] - self.replayed["catch_up"]
        seconds = self.seen["switch"] - self.seen["catch_up"]
        return (n / seconds if seconds > 0 else float("nan")), n, seconds

    def bulk_seconds(self) -> float | None:
        """From the first sighting of the bulk phase to the first of a later one."""
        if "bulk" not in self.seen:
            return None
        after = [t for phase, t in self.phases().items() if t > self.seen["bulk"]]
        return (min(after) - self.seen["bulk"]) if after else None


def _writes_during(
    stack: Any, writes: list[Any], watch: PhaseWatch, marks: dict[str, float]
) -> dict[str, Any]:
    """The writes' figures: the rate acknowledged during the rollout (measured), the
    catch-up's replay rate, the log entries that carried the target's vectors, and the
    acknowledged writes the new generation does not hold (``bench/rollout_writes.py``)."""
    start, end = marks["rollout_start"], marks["rollout_end"]
    acked = [w for w in writes if w.ok and start <= w.start < end]
    rate, replayed, seconds = watch.catch_up_rate()
    client = stack.redis()
    try:
        names = watch.names
        p0_at = watch.seen.get("train", start)  # P0 is recorded before the train phase
        checked = check_writes(client, writes, names["source"], names["target"], p0_at)
        dual = dual_counts(client, names["source"], {int(k): v for k, v in names["p0"].items()})
    finally:
        client.close()
    outcomes = dual_encode_outcomes(stack.state()["gateway_metrics"])
    print(
        f"dual encodes, by outcome (the gateway's counter): {outcomes}; "
        f"writes: {len(acked) / (end - start):.1f}/s acknowledged during the rollout "
        f"({len(acked)}; {sum(not w.ok for w in writes)} failed in all); catch-up replayed "
        f"{replayed} entries in {seconds:.1f} s = {rate:.1f}/s; upsert entries since P0 "
        f"{dual['upsert_entries']}, {dual['with_target_vectors']} with the target's "
        f"vectors; {checked.checked} acknowledged writes after P0 checked, "
        f"{len(checked.lost)} lost {checked.lost[:10]}"
    )
    return {
        "writes_per_s": len(acked) / (end - start),
        "writes_acked_during": len(acked),
        "writes_failed": sum(not w.ok for w in writes),
        "catch_up_entries_per_s": rate,
        "catch_up_entries": replayed,
        "catch_up_seconds": seconds,
        "upsert_entries_since_p0": dual["upsert_entries"],
        "entries_with_target_vectors": dual["with_target_vectors"],
        "dual_encodes": outcomes,
        "writes_checked": checked.checked,
        "lost_writes": len(checked.lost),
        "lost_examples": checked.lost[:10],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_stack_arguments(parser, docs=1500, writes_per_s=5.0)
    parser.add_argument("--batch", type=int, default=32, help="builder and in-process batch")
    parser.add_argument(
        "--parallel", type=int, default=0, help="`index rollout --parallel` (0: its default)"
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=300,
        help="the builder's training sample (300): the train phase encodes these, the "
        "measured bulk phase the rest",
    )
    parser.add_argument(
        "--pace",
        default="",
        help="`index rollout --pace` (RATIO or 'off'; default: its default)",
    )
    parser.add_argument("--encoder", type=Path, help="new encoder (default: perturbed MiniLM)")
    parser.add_argument(
        "--retrain",
        action="store_true",
        help="roll out `--retrain` (the serving encoder, the replicas' vectors) instead of "
        "a new encoder; no in-process baseline (nothing is re-embedded). Default --out: "
        "bench/results/rollout_retrain_writes.json",
    )
    parser.add_argument(
        "--document-precision",
        choices=["int8", "fp32"],
        default="int8",
        help="documents of both encoders: int8 (default, as `up --document-precision int8` "
        "serves them: the stack's export and the new encoder's, one document per run) or fp32",
    )
    parser.add_argument(
        "--catch-up-factor",
        default=None,
        metavar="FACTOR|off",
        help="passed to `index rollout --catch-up-factor` (default: the rollout's, 4)",
    )
    parser.add_argument(
        "--int8-gate",
        action="store_true",
        help="run the new encoder's int8 quality gates on SciFact first (minutes)",
    )
    parser.add_argument(
        "--redis-fsync",
        choices=("always", "everysec"),
        help="`up --redis-fsync` (default: up's, always)",
    )
    parser.add_argument("--out", type=Path, default=None, help="bench/results/rollout.json")
    args = parser.parse_args(argv)
    if args.out is None:
        name = "rollout_retrain_writes.json" if args.retrain else "rollout.json"
        args.out = Path("bench/results") / name
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from services.encoder.build.export import export_onnx
    from tests.support.encoders import ensure_second_encoder
    from tests.support.local_stack import local_stack, small_corpus

    machine = cpu_sets.available()
    budget = rollout_budget(args.cpus, machine)
    threads = len(budget or machine)  # the in-process baseline gets what the rollout gets
    cli_budget = ["--cpus", cpu_sets.format_cpus(budget)] if budget else []
    with tempfile.TemporaryDirectory(prefix="gtr-bench-rollout-") as tmp_name:
        tmp = Path(tmp_name)
        corpus = tmp / "corpus.jsonl"
        small_corpus(SCIFACT, corpus, args.docs, args.text_chars)
        texts = _texts(corpus)
        onnx_path = tmp / "onnx" / "model.onnx"
        whole, inproc = float("nan"), []
        int8_gates: dict[str, Any] = {}
        what = ["--retrain"]
        if not args.retrain:
            encoder = args.encoder or ensure_second_encoder(tmp)
            what = ["--encoder", str(encoder)]
            if args.document_precision == "int8":
                int8_gates = int8_export(encoder, onnx_path, args.int8_gate)
                what = ["--encoder", str(onnx_path.parent)]  # the export folder is published
                if not int8_gates.get("gated"):  # its quality gate refused it, or did not run
                    what.append("--int8-unmeasured")
            else:
                export_onnx(encoder, onnx_path)
                _record_parity(encoder, onnx_path)
            whole = inprocess_docs_per_s(onnx_path, texts, args.batch, len(machine))
            print(f"in-process ONNX on every CPU ({len(machine)} threads): {whole:.1f} docs/s")
            inproc = [_inprocess_on(budget, onnx_path, texts, args.batch, threads)]
            print(
                f"in-process ONNX on the rollout's CPUs ({threads} threads, batches of "
                f"{args.batch}): {inproc[0]:.1f} docs/s",
                flush=True,
            )

        run_dir = args.run_dir or tmp / "run"
        print(f"starting the stack on {args.docs} documents ({run_dir})", flush=True)
        with (
            local_stack(
                run_dir,
                tmp / "up.log",
                corpus=corpus,
                shards=2,
                extra=[
                    "--document-precision",
                    args.document_precision,
                    "--triton-nice",
                    str(args.triton_nice),
                    *(["--redis-fsync", args.redis_fsync] if args.redis_fsync else []),
                ],
            ) as stack,
            RoleCpu(os.getpid(), stack_file=run_dir / "stack.json") as cpu,
        ):
            load = steady_load(stack, args.searches_per_s, args.writes_per_s, budget)
            marks: dict[str, float] = {}
            rollout_out = tmp / "rollout.log"
            watch = PhaseWatch(stack.redis_url)

            async def scenario() -> subprocess.CompletedProcess[str]:
                runner = asyncio.ensure_future(load.run())
                try:
                    await asyncio.sleep(args.before_s)  # the measured window before
                    held = stack.redis()
                    hold_source(held)  # the write check reads its logs after the switch
                    held.close()
                    # the watcher polling first (a blocking wait: not on the load's loop)
                    await asyncio.to_thread(watch.__enter__)
                    marks["rollout_start"] = time.monotonic()
                    marks["before_start"] = marks["rollout_start"] - args.before_s
                    with watch:
                        done = await asyncio.to_thread(
                            stack.run_cli,
                            "index",
                            "rollout",
                            *what,
                            "--batch",
                            str(args.batch),
                            "--sample",
                            str(args.sample),
                            *(["--parallel", str(args.parallel)] if args.parallel else []),
                            *(["--pace", args.pace] if args.pace else []),
                            *(
                                ["--catch-up-factor", args.catch_up_factor]
                                if args.catch_up_factor
                                else []
                            ),
                            "--run-dir",
                            str(run_dir),
                            "--yes",
                            *cli_budget,
                            timeout=3600,
                            log=rollout_out,
                        )
                    marks["rollout_end"] = time.monotonic()
                    marks.update({f"phase_{k}": v for k, v in watch.phases().items()})
                    marks["bulk_seconds"] = watch.bulk_seconds() or float("nan")
                    marks["bulk_appended"] = watch.bulk_appended - (watch.bulk_first or 0)
                    # a few seconds of writes to the new generation, then stop
                    await asyncio.sleep(3.0)
                finally:
                    load.stop()
                    await runner
                return done

            done = asyncio.run(scenario())
            if done.returncode != 0:
                raise SystemExit(
                    f"index rollout failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
                )
            writes = _writes_during(stack, load.record.writes, watch, marks)
            budget_log = budget_lines(tmp / "up.log")
        if not args.retrain:
            inproc.append(_inprocess_on(budget, onnx_path, texts, args.batch, threads))

    record = load.record
    print(f"timeline (rollout from {start_s(marks, load):.0f} s):\n{record.timeline(2.0)}")
    print(f"cores by role (every 2 s, the same origin):\n{cpu.timeline(record.started)}")
    start, end = marks["rollout_start"], marks["rollout_end"]
    before = [s for s in record.searches if s.start < start]
    during = [s for s in record.searches if start <= s.start < end]
    ok_before = [s.latency for s in before if s.code == "OK"]
    ok_during = [s.latency for s in during if s.code == "OK"]
    bulk_s = marks["bulk_seconds"]
    bulk_docs = int(marks["bulk_appended"])
    reembed = bulk_docs / bulk_s if bulk_s == bulk_s and bulk_s > 0 else float("nan")
    inproc_rate = statistics.mean(inproc) if inproc else float("nan")
    result: dict[str, Any] = {
        "docs": args.docs,
        "bulk_docs": bulk_docs,
        "bulk_seconds": bulk_s,
        "reembed_docs_per_s": reembed,
        "inprocess_docs_per_s": inproc_rate,
        "inprocess_rounds": [round(r, 1) for r in inproc],
        "inprocess_every_cpu_docs_per_s": whole,
        "cpu_budget": cpu_sets.format_cpus(budget) if budget else "none",
        "reembed_ratio": reembed / inproc_rate,
        "rollout_seconds": end - start,
        "searches_before": len(before),
        "searches_during": len(during),
        "failed_before": len(before) - len(ok_before),
        "failed_during": len(during) - len(ok_during),
        "p50_before_ms": 1e3 * float(np.median(ok_before)) if ok_before else float("nan"),
        "p50_during_ms": 1e3 * float(np.median(ok_during)) if ok_during else float("nan"),
        "p99_before_ms": 1e3 * p99(ok_before),
        "p99_during_ms": 1e3 * p99(ok_during),
        "searches_per_s": args.searches_per_s,
        "writes_per_s_asked": args.writes_per_s,
        "batch": args.batch,
        "parallel": args.parallel or None,  # None: index rollout's default
        "threads": threads,
        "phases_s": {
            k.removeprefix("phase_"): round(v - start, 2)
            for k, v in marks.items()
            if k.startswith("phase_")
        },
    }
    result["p99_during_over_before"] = result["p99_during_ms"] / result["p99_before_ms"]
    interval = p99_ratio_interval(
        ([s.start for s in before if s.code == "OK"], ok_before),
        ([s.start for s in during if s.code == "OK"], ok_during),
    )
    result["p99_during_over_before_ci95"] = (
        [round(v, 3) for v in interval] if interval is not None else None
    )
    result["cpu_cores"] = {
        "before": cpu.cores(marks["before_start"], start),
        "during": cpu.cores(start, end),
    }
    result |= writes
    result["mode"] = "retrain" if args.retrain else "encoder"
    result["document_precision"] = args.document_precision
    result["redis_fsync"] = args.redis_fsync or "always"
    result["new_encoder_int8"] = int8_gates
    result["pace"] = args.pace or f"default ({PACE})"
    result["catch_up_factor"] = args.catch_up_factor or "default (4)"
    result["pacing"] = pacing_summary(f"{done.stdout}\n{done.stderr}")
    result["cpu_budget_log"] = budget_log
    for said in budget_log:
        print(f"up: {said}")
    result["p99_by_phase_ms"] = p99_by_phase(record.searches, marks, end)
    result["switch_searches"] = switch_searches(record, marks, end)
    # where a search's time goes, before and during: the gateway's own stage timings
    result["stage_p99_ms"] = {}
    for window, ops in (("before", before), ("during", during)):
        timed = [s for s in ops if s.stages]
        if timed:
            result["stage_p99_ms"][window] = {
                name: round(float(np.percentile([s.stages[name] for s in timed], 99)), 1)
                for name in ("encode", "search", "fetch", "total")
            }
    print(
        f"re-embed: {bulk_docs} documents in {bulk_s:.1f} s of bulk = {reembed:.1f} docs/s; "
        f"in-process {inproc_rate:.1f} docs/s (rounds {', '.join(f'{r:.1f}' for r in inproc)}); "
        f"ratio {result['reembed_ratio']:.2f} (goal >= 0.8)"
    )
    for window, used in result["cpu_cores"].items():
        print(f"cores used {window}: " + ", ".join(f"{k} {v:.2f}" for k, v in used.items()))
    print(
        f"search p99: {result['p99_before_ms']:.1f} ms before ({len(before)} searches, "
        f"{result['failed_before']} failed), {result['p99_during_ms']:.1f} ms during the "
        f"rollout ({len(during)}, {result['failed_during']} failed): "
        f"{result['p99_during_over_before']:.2f}x (goal <= 1.5; 95 % block-bootstrap "
        f"interval {result['p99_during_over_before_ci95']})"
    )
    line = {
        k: (None if v != v else round(v, 3)) if isinstance(v, float) else v  # NaN: null
        for k, v in result.items()
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "source": {
                    "bench": "rollout",
                    "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                },
                **line,
            },
            indent=2,
        )
        + "\n"
    )
    print(json.dumps(line))
    return result


def budget_lines(up_log: Path) -> list[str]:
    """What ``up`` said of the CPU budget (``CPU budget ...``: serving's measured load
    moving it onto every CPU or off the budget's again), its log prefix dropped."""
    try:
        text = up_log.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line[line.index("CPU budget") :] for line in text.splitlines() if "CPU budget" in line]


def pacing_summary(text: str) -> dict[str, Any] | None:
    """The builder's ``pacing summary {json}`` line in ``index rollout``'s output (None:
    it paced no encode call)."""
    found = [line for line in text.splitlines() if "pacing summary " in line]
    if not found:
        return None
    summary: dict[str, Any] = json.loads(found[-1].split("pacing summary ", 1)[1])
    return summary


if __name__ == "__main__":
    main()
