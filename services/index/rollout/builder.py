"""The rollout builder: builds the next generation beside the serving one and switches to
it, resumable after a crash anywhere (docs/generations.md, "The rollout").

Phases, each recorded in ``{gtr}:rollout`` (``phase``) before it starts, with the progress
it needs to resume (a SCAN cursor, per-shard log positions) saved after every batch:

``publish``   (``--encoder``) take the lock first, then publish the checkpoint as a version
              of Triton's ``embed`` (``publisher``; the same export again returns the
              version already there), record it in the plan and write T's record: a
              retire, an ``encoder unpublish`` or another rollout sees the lock during the
              publish, so none unpublishes the version it is about to use
              (:func:`~services.encoder.serve.versions.generations_using`, checked under
              the repository's publish lock); a publish refused or failed ends the
              rollout with nothing recorded
``create``    take the lock, record the target T (``building``)
``p0``        record P0, the tails of the source S's logs; a *hold* (``rollout:<T>`` in S's
              ``snap:`` hashes) keeps S's shards from trimming their logs past the
              replay position until the switch
``train``     (new encoder) encode the first ``sample`` documents of a SCAN of S's layout,
              append them, train T's quantizer on them with the recall-tuned nprobe
              (:func:`services.index.core.train.train_index`), mark ``params["trained"]``
              (T's shards start then); (``--retrain``) stream every vector S's replicas
              hold (``ExportVectors``, once each has applied P0), append them as version 0,
              train on a reservoir sample of them
``bulk``      (new encoder) the rest of the SCAN: re-embed, append; the cursor is saved
``catch_up``  replay S's logs from P0 (re-embedding each upsert's text from the entry)
              until the lag is at most ``switch_lag`` entries
``switch``    close S's writer gates, replay to S's final tails, wait until T's replicas
              applied T's tails, switch the alias (T's tails as its ``switch_in``), open
              T's gates; a hold ``rollback:<S>`` on T's logs keeps every write since the
              switch for ``index rollback`` until S is retired

Every append goes through :class:`~services.index.rollout.append.TargetAppender`, so any
batch run twice (a builder killed after appending, before saving its progress) appends
nothing twice. A rollback is the same machine from ``catch_up``: the serving
generation's logs replayed from its ``switch_in`` into the previous one.

The store is reached with a blocking client (bytes replies): the builder is one process
with nothing else to serve, and its Redis calls are short; the encoder is async.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from services.common import cpus as cpu_sets
from services.common import positions
from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RetrievalError,
    Unavailable,
)
from services.encoder.base import Encoder
from services.index.changelog import text
from services.index.generations import EncoderSpec, Generation, Registry
from services.index.keys import CLOSED, CPU_PLACED_KEY, GenerationKeys
from services.index.rollout.append import (
    RETRAIN_VERSION,
    DeleteItem,
    TargetAppender,
    UpsertItem,
)
from services.index.rollout.progress import Progress

if TYPE_CHECKING:
    from services.common.tls import ClientTLS

log = logging.getLogger(__name__)

EncoderFactory = Callable[[EncoderSpec], Awaitable[Encoder]]
# publishes a checkpoint folder (--encoder) as a version of Triton's embed; blocking (the
# export and Triton's load take seconds), run in a thread
Publisher = Callable[[str], EncoderSpec]
Exporter = Callable[[str], AsyncIterator[tuple[list[str], np.ndarray, str]]]
AppliedProbe = Callable[[str], Awaitable[list[list[str | None]]]]


@dataclass(frozen=True)
class RolloutOptions:
    index_root: Path  # T's trained index goes to index_root / T's name
    batch: int = 64  # documents (or log entries) per batch; the progress is saved after each
    sample: int = 100_000  # training vectors at most (the first documents of the SCAN)
    parallel: int = 2  # encoder batches in flight (keeps a Triton busy while Redis answers)
    # texts per encode call at most (and the encoder's max_batch): Triton runs a query's
    # encode (higher priority) after the batch already running, so this bounds how long
    # a search waits behind the builder; smaller = less wait, more per-call overhead
    encode_batch: int = 16
    switch_lag: int = 256  # source log entries behind, at most, before the switch starts
    wait_for_shards: bool = True  # the switch waits for T's replicas to apply T's logs
    shard_wait_s: float = 300.0  # ...at most this long per attempt
    switch_attempts: int = 3
    # the switch waits this long at most for a local stack to move T's processes off a CPU
    # budget (--cpus) onto serving's CPUs (services/stack/cpu_budget.py "The hand-over")
    hand_over_s: float = 3.0
    stale_after_s: float = 15.0  # a rollout whose builder is silent this long is resumable
    heartbeat_s: float = 1.0
    target_recall: float | None = None  # None: the trainer's default
    encode_timeout_s: float = 60.0
    encode_retry_s: float = 300.0  # how long a failing encoder is retried before giving up


@dataclass(frozen=True)
class RolloutPlan:
    """What ``index rollout`` was asked for."""

    encoder: EncoderSpec | None = None  # None: the serving generation's encoder
    num_shards: int | None = None  # None: the serving generation's shard count
    retrain: bool = False  # reuse the vectors S's replicas hold (same encoder)
    encoder_dir: str = ""  # the checkpoint folder --encoder named (a resume names it again)


def _j(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def embedding_text(title: str, body: str) -> str:
    """What the encoder reads of a document: the gateway's text and cut, so a re-embedded
    document gets the vector the gateway would give it."""
    from services.gateway.texts import cut_for_encoder

    return cut_for_encoder(f"{title} {body}" if title else body)[0]


class Takeover(FailedPrecondition):
    """Another builder took this rollout over (this one was silent too long)."""


class RolloutBuilder:
    """Runs, resumes, aborts and rolls back rollouts (``client``: blocking Redis with bytes
    replies; ``encoders``: an encoder for a generation's :class:`EncoderSpec`)."""

    def __init__(
        self,
        client: Any,
        encoders: EncoderFactory,
        options: RolloutOptions,
        progress: Progress | None = None,
        *,
        exporter: Exporter | None = None,
        applied: AppliedProbe | None = None,
        source_addresses: str | None = None,
        shard_tls: ClientTLS | None = None,
        publisher: Publisher | None = None,
    ) -> None:
        self.redis: Any = client
        self.registry = Registry(client)
        self.encoders = encoders
        self.options = options
        self.progress = progress or Progress()
        self.exporter = exporter
        self.applied = applied
        self.source_addresses = source_addresses  # g1's shards when `{gtr}:addrs` lacks them
        # how S's replicas (--retrain's export) and T's (the switch's wait) are reached:
        # TLS, mTLS with a client certificate, or plaintext (None)
        self.shard_tls = shard_tls
        self.publisher = publisher  # the publish phase's (a plan with encoder_dir only)
        self._probed: set[str] = set()  # replicas whose transport was checked
        self.owner = uuid.uuid4().hex
        self._encoder: Encoder | None = None
        self._state: dict[str, str] = {}

    # --- entry points -------------------------------------------------------------------

    async def rollout(self, plan: RolloutPlan) -> Generation:
        """Start a rollout, or resume the one recorded (when its builder is gone and
        ``plan`` asks for nothing else); the serving generation when done."""
        running = self.registry.rollout()
        if running is not None:
            self.check_resumable(running, plan)
            return await self._resume(running)
        serving = self.registry.serving()
        if plan.retrain and (plan.encoder is not None or plan.encoder_dir):
            raise InvalidArgument("--retrain reuses the serving encoder's vectors: no --encoder")
        publish = plan.encoder is None and bool(plan.encoder_dir)
        if publish and self.publisher is None:
            raise FailedPrecondition(
                "--encoder: no Triton model repository to publish it into (give "
                "--triton-repo, or --run-dir of a running local stack)"
            )
        num_shards = plan.num_shards or serving.num_shards
        if num_shards < 1:
            raise InvalidArgument(f"--shards {num_shards}: at least 1")
        encoder = plan.encoder or serving.encoder
        if encoder.dim and serving.encoder.dim and plan.retrain and encoder != serving.encoder:
            raise InvalidArgument("--retrain keeps the serving encoder")
        if plan.retrain and not (self.registry.addresses(serving.name) or self.source_addresses):
            raise FailedPrecondition(
                f"--retrain reuses the vectors {serving.name}'s replicas hold, but their "
                "addresses are unknown ({gtr}:addrs names none): give --source-shards"
            )
        if plan.retrain:  # a TLS / plaintext mismatch refused before anything is recorded
            from services.index.rollout.replicas import parse_addresses

            spec = self.registry.addresses(serving.name) or self.source_addresses or ""
            for address in (a for replicas in parse_addresses(spec) for a in replicas):
                await self._check_transport(address)
        mode = "retrain" if plan.retrain else "encode"
        now = time.time()
        # With --encoder the lock comes first and the publish is its first phase: T's
        # record, which needs the published version, is written at the phase's end. The
        # lock takes T's name with it: a refused rollout uses no number up.
        name = self.registry.begin_rollout(
            {
                "source": serving.name,
                "kind": "rollout",
                "mode": mode,
                "phase": "publish" if publish else "create",
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": str(os.getpid()),
                "beat": repr(now),
                "started_at": repr(now),
                "plan": _j(
                    {
                        "encoder": None if publish else encoder.__dict__,
                        "shards": num_shards,
                        "retrain": plan.retrain,
                        "encoder_dir": plan.encoder_dir,
                    }
                ),
            }
        )
        if not publish:
            self._record_target(name, serving.name, num_shards, encoder, mode, now)
        return await self._resume(self.registry.rollout() or {})

    def _record_target(
        self, name: str, source: str, num_shards: int, encoder: EncoderSpec, mode: str, now: float
    ) -> None:
        index_dir = str(Path(self.options.index_root).resolve() / name)
        self.registry.put(
            Generation(
                name,
                "building",
                num_shards,
                encoder,
                index_dir,
                {"trained": False, "source": source, "mode": mode},
                created_at=now,
            )
        )

    async def rollback(self) -> Generation:
        """Make the previous generation serve again: replay every write since the switch
        into it (re-embedded with its encoder), then the same switch."""
        running = self.registry.rollout()
        if running is not None:
            self.check_resumable(running, RolloutPlan())
            if running.get("kind") != "rollback":
                raise FailedPrecondition(
                    f"a rollout to {running.get('target')} was interrupted: finish it with "
                    "`index rollout` or `index rollout --abort` first"
                )
            return await self._resume(running)
        alias = self.registry.alias()
        if not alias.previous:
            raise FailedPrecondition(
                f"no previous generation to roll back to ({alias.serving} serves and none "
                "served before it, or it was retired)"
            )
        target = self.registry.get(alias.previous)
        serving = self.registry.get(alias.serving)
        if target.state != "previous":
            raise FailedPrecondition(f"generation {target.name} is {target.state}, not previous")
        if not serving.switch_in:
            raise FailedPrecondition(
                f"{serving.name} has no switch-in positions (it never switched in): nothing "
                "to replay from"
            )
        src = self.registry.keys(serving)
        start = {int(s): p for s, p in serving.switch_in.items()}
        for shard, position in start.items():
            if _trimmed_past(self.redis, src.log(shard), position):
                raise FailedPrecondition(
                    f"{src.log(shard)} was trimmed past the switch ({position}): the writes "
                    f"since cannot be replayed into {target.name}; roll out a new generation "
                    "instead"
                )
        now = time.time()
        self.registry.begin_rollout(
            {
                "target": target.name,
                "source": serving.name,
                "kind": "rollback",
                "mode": "replay",
                "phase": "catch_up",
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": str(os.getpid()),
                "beat": repr(now),
                "started_at": repr(now),
                "target_state": target.state,
                "p0": _j(start),
                "positions": _j(start),
                "replayed": _j({}),
                "added0": _j(serving.params.get("switch_added", {})),
            }
        )
        self._hold(src, start, f"rollout:{target.name}")
        self.registry.set_state(target.name, "catching_up")
        return await self._resume(self.registry.rollout() or {})

    def abort(self) -> dict[str, str]:
        """Close the recorded rollout: writes back to the source, the target ``failed``
        (a rollback's target back to ``previous``), the holds released; the rollout's
        fields as they were."""
        running = self.registry.rollout()
        if running is None:
            raise FailedPrecondition("no rollout is running")
        # Never under a live builder: it could switch the alias after the gates went back.
        self._wait_until_silent(running)
        target, source = running["target"], running["source"]
        alias = self.registry.alias()
        if alias.serving == target:
            self.registry.end_rollout()  # the switch had happened: only the lock was left
            raise FailedPrecondition(
                f"{target} serves already (the switch was done); `index rollback` returns "
                f"to {source}"
            )
        src_gen = self.registry.get(source)
        src = self.registry.keys(src_gen)
        self.registry.set_gates(src.layout, source)
        self._release(src, f"rollout:{target}")
        try:
            gen = self.registry.get(target)
        except NotFound:
            gen = None
        if gen is not None:
            if running.get("kind") == "rollback":
                self.registry.set_state(target, running.get("target_state", "previous"))
            else:
                self.registry.set_state(target, "failed", note="aborted")
        self.registry.end_rollout()
        return running

    # --- resume -------------------------------------------------------------------------

    def check_resumable(self, running: dict[str, str], plan: RolloutPlan) -> None:
        """FailedPrecondition unless the recorded rollout's builder is gone and ``plan``
        asks for nothing else. A builder on this host is gone when its pid is; one on
        another host (a Job's previous pod) when its heartbeat stops: this waits up to
        ``stale_after_s`` to see which."""
        self._wait_until_silent(running)
        asked = (
            plan.encoder is not None
            or plan.num_shards is not None
            or plan.retrain
            or bool(plan.encoder_dir)
        )
        if asked and running.get("kind") == "rollout":
            recorded = json.loads(running.get("plan", "{}"))
            same = (
                (plan.num_shards is None or plan.num_shards == recorded.get("shards"))
                and plan.retrain == bool(recorded.get("retrain"))
                and (plan.encoder is None or plan.encoder.__dict__ == recorded.get("encoder"))
                and (not plan.encoder_dir or plan.encoder_dir == recorded.get("encoder_dir"))
            )
            if not same:
                raise FailedPrecondition(
                    f"a rollout to {running.get('target')} was interrupted (phase "
                    f"{running.get('phase')}) with other options: resume it with `index "
                    "rollout` (no options, or the same ones) or `index rollout --abort` first"
                )

    def _wait_until_silent(self, running: dict[str, str]) -> None:
        alive = FailedPrecondition(
            f"a rollout to {running.get('target')} is running (phase "
            f"{running.get('phase')}, builder pid {running.get('pid')} on "
            f"{running.get('host')}): wait for it, or stop it and `index rollout --abort`"
        )
        if running.get("host") == socket.gethostname() and running.get("pid"):
            if cpu_sets.running(int(running["pid"])):
                raise alive
            return
        first = running.get("beat", "0") or "0"
        deadline = time.monotonic() + self.options.stale_after_s + 2 * self.options.heartbeat_s
        while time.time() - float(first) < self.options.stale_after_s:
            time.sleep(min(0.5, self.options.heartbeat_s))
            now = self.registry.rollout()
            if now is None:
                raise FailedPrecondition(
                    f"the rollout to {running.get('target')} ended meanwhile: see `index "
                    "generations`"
                )
            if (now.get("beat") or "0") != first or time.monotonic() > deadline:
                raise alive

    async def _resume(self, running: dict[str, str]) -> Generation:
        self.redis.hset(
            "{gtr}:rollout",
            mapping={
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": str(os.getpid()),
                "beat": repr(time.time()),
            },
        )
        self._state = dict(running, owner=self.owner)
        beat = asyncio.create_task(self._heartbeat())
        try:
            return await self._run()
        finally:
            beat.cancel()
            if self._encoder is not None:
                await self._encoder.close()
                self._encoder = None

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.options.heartbeat_s)
            await asyncio.to_thread(self._beat)

    def _beat(self) -> None:
        owner = self.redis.hget("{gtr}:rollout", "owner")
        if owner is None or text(owner) != self.owner:
            return
        self.redis.hset("{gtr}:rollout", "beat", repr(time.time()))
        held = self._state.get("positions")
        if held and self._state.get("phase") in ("train", "bulk", "catch_up", "switch"):
            src = self.registry.keys(self.registry.get(self._state["source"]))
            now, name = repr(time.time()), f"rollout:{self._state['target']}"
            for shard in json.loads(held):
                self.redis.hset(src.replicas_seen(int(shard)), name, now)

    def _save(self, **fields: str) -> None:
        """Record progress, unless another builder took the rollout over."""
        owner = self.redis.hget("{gtr}:rollout", "owner")
        if owner is None or text(owner) != self.owner:
            raise Takeover(
                f"the rollout to {self._state.get('target')} was taken over or aborted: "
                "this builder stops"
            )
        self.redis.hset("{gtr}:rollout", mapping=fields)
        self._state.update(fields)

    async def _run(self) -> Generation:
        order = ["publish", "create", "p0", "train", "bulk", "catch_up", "switch"]
        while True:
            phase = self._state.get("phase", "create")
            if phase == "done":
                break
            if phase not in order:
                raise FailedPrecondition(f"{{gtr}}:rollout has an unknown phase {phase!r}")
            self.progress.phase(phase)
            step = getattr(self, f"_phase_{phase}")
            await step()
        self.registry.end_rollout()
        return self.registry.serving()

    # --- the phases ---------------------------------------------------------------------

    def _target(self) -> Generation:
        return self.registry.get(self._state["target"])

    def _source(self) -> Generation:
        return self.registry.get(self._state["source"])

    async def _phase_publish(self) -> None:
        """Publish ``--encoder`` under the lock taken (a resume publishes the same folder
        again: the version already there comes back), then record it in the plan and
        write T's record. A publish that fails (refused, Triton unreachable: the
        repository is put back as it was) ends the rollout: nothing else was recorded, so
        nothing is left to resume or abort."""
        plan = json.loads(self._state.get("plan") or "{}")
        folder = plan.get("encoder_dir") or ""
        if not folder:
            raise FailedPrecondition("{gtr}:rollout is publishing, but its plan names no folder")
        if self.publisher is None:
            raise FailedPrecondition(
                f"the rollout to {self._state['target']} stopped while publishing {folder}: "
                "resuming it needs Triton's model repository (--triton-repo, or --run-dir of "
                "the local stack), or `index rollout --abort`"
            )
        try:
            spec = await asyncio.to_thread(self.publisher, folder)
        except Exception:  # refused, or failed in the export (torch, a full disk, ...)
            owner = self.redis.hget("{gtr}:rollout", "owner")
            if owner is not None and text(owner) == self.owner:
                self.registry.end_rollout()  # the lock was all there was
            raise
        plan["encoder"] = spec.__dict__
        # T's record first: a crash before the phase moves publishes again (the same
        # version) and writes the same record
        self._record_target(
            self._state["target"],
            self._state["source"],
            int(plan["shards"]),
            spec,
            self._state.get("mode", "encode"),
            float(self._state.get("started_at") or time.time()),
        )
        self._save(plan=_j(plan), phase="create")

    async def _phase_create(self) -> None:
        # The record is written right after the lock; a crash between the two leaves none.
        try:
            self._target()
        except NotFound:
            raise FailedPrecondition(
                f"the rollout to {self._state['target']} stopped before recording it: "
                "`index rollout --abort`, then start again"
            ) from None
        self._save(phase="p0")

    async def _phase_p0(self) -> None:
        src = self.registry.keys(self._source())
        zero = {s: positions.ZERO for s in range(src.num_shards)}
        # Hold S's logs from 0-0 first (no trim passes it), then at P0: no write between
        # reading the tails and registering the hold can be trimmed away.
        self._hold(src, zero, f"rollout:{self._state['target']}")
        p0 = {s: _last_id(self.redis, src.log(s)) for s in range(src.num_shards)}
        added = {s: _entries_added(self.redis, src.log(s)) for s in range(src.num_shards)}
        self._hold(src, p0, f"rollout:{self._state['target']}")
        self._save(
            p0=_j(p0),
            positions=_j(p0),
            replayed=_j({s: 0 for s in p0}),
            added0=_j(added),
            phase="train",
        )

    async def _phase_train(self) -> None:
        target = self._target()
        if target.params.get("trained"):
            self._save(phase="bulk" if self._state.get("mode") == "encode" else "catch_up")
            return
        if self._state.get("mode") == "retrain":
            sample = await self._export_all(target)
        else:
            sample = await self._encode_sample(target)
        if sample.shape[0] == 0:
            raise FailedPrecondition(
                f"{self._state['source']}'s documents are none: nothing to train on"
            )
        manifest = await asyncio.to_thread(self._train, target, sample)
        params = dict(
            target.params,
            trained=True,
            nprobe=manifest.nprobe,
            nlist=manifest.nlist,
            train_points=manifest.train_points,
            measured_recall=manifest.measured_recall,
        )
        self.registry.put(replace(target, params=params))
        self.progress.message(
            f"{target.name}: trained on {manifest.train_points} vectors (nlist "
            f"{manifest.nlist}, nprobe {manifest.nprobe}) in {target.index_dir}"
        )
        self._save(phase="bulk" if self._state.get("mode") == "encode" else "catch_up")

    def _train(self, target: Generation, sample: np.ndarray) -> Any:
        from services.index.core.train import TARGET_RECALL, TrainOptions, train_index

        source_manifest = _manifest(self._source().index_dir)
        options = TrainOptions(
            max_train_points=self.options.sample,
            model=target.encoder.source or target.encoder.model,
            refine=source_manifest.get("refine", True),
            refine_factor=int(source_manifest.get("refine_factor", 4)),
            pq_bits=int(source_manifest.get("pq_bits", 8)),
            target_recall=self.options.target_recall or TARGET_RECALL,
        )
        return train_index(sample, Path(target.index_dir), options)

    async def _encode_sample(self, target: Generation) -> np.ndarray:
        """Encode and append the first ``sample`` documents of the SCAN; the cursor after
        them is where the bulk pass goes on."""
        rows: list[np.ndarray] = []
        have = 0
        cursor = _ScanCursor.start()
        total = self._count_documents()
        self._save(total=str(total))
        self.progress.total(total)
        async for batch, after in self._scan(cursor):
            vectors = await self._append_documents(batch, target)
            rows.append(vectors)
            have += vectors.shape[0]
            self.progress.advance(len(batch))
            if have >= self.options.sample:
                cursor = after
                break
        else:
            cursor = _ScanCursor.finished()
        self._save(cursor=cursor.dump(), done=str(have))
        dim = target.encoder.dim or (rows[0].shape[1] if rows else 0)
        return np.concatenate(rows) if rows else np.zeros((0, dim), np.float32)

    async def _phase_bulk(self) -> None:
        target = self._target()
        cursor = _ScanCursor.load(self._state.get("cursor", ""))
        done = int(self._state.get("done", "0"))
        total = int(self._state.get("total", "0")) or self._count_documents()
        self.progress.total(total, done)
        # Up to `parallel` batches in flight: the next SCAN and document reads overlap the
        # encoding of the ones before (Triton is not left idle while Redis answers). The
        # cursor saved is the one after the oldest batch finished with every batch
        # before it: a crash re-runs at most the batches in flight (appends idempotent).
        pending: deque[tuple[_ScanCursor, int, asyncio.Task[np.ndarray]]] = deque()

        async def finish_oldest() -> None:
            nonlocal done
            after, n, task = pending.popleft()
            await task
            done += n
            self.progress.advance(n)
            self._save(cursor=after.dump(), done=str(done))

        try:
            if not cursor.finished_:
                async for batch, after in self._scan(cursor):
                    task = asyncio.create_task(self._append_documents(batch, target))
                    pending.append((after, len(batch), task))
                    while len(pending) >= max(1, self.options.parallel) or (
                        pending and pending[0][2].done()
                    ):
                        await finish_oldest()
                while pending:
                    await finish_oldest()
        finally:
            for _, _, task in pending:
                task.cancel()
        self.registry.set_state(target.name, "catching_up")
        self._save(phase="catch_up")

    async def _phase_catch_up(self) -> None:
        self.registry.set_state(self._state["target"], "catching_up")
        while True:
            read = await self._replay(until=None)
            lag = self._lag()
            lag = read if lag is None else lag
            self.progress.lag(lag)
            if lag <= self.options.switch_lag:
                break
        self._save(phase="switch")

    async def _phase_switch(self) -> None:
        target, source = self._target(), self._source()
        alias = self.registry.alias()
        tgt = self.registry.keys(target)
        src = self.registry.keys(source)
        if alias.serving != target.name:
            await self._handed_over(target)
            for attempt in range(1, self.options.switch_attempts + 1):
                self.registry.set_state(target.name, "switching")
                self.registry.set_gates(src.layout, CLOSED)
                # Every write acknowledged from now on is refused (GenerationMoved; the
                # gateway retries it once the alias moved): S's logs end here.
                finals = {s: _last_id(self.redis, src.log(s)) for s in range(src.num_shards)}
                await self._replay(until=finals)
                tails = {s: _last_id(self.redis, tgt.log(s)) for s in range(tgt.num_shards)}
                if await self._target_applied(target, tails):
                    self._save(phase="switch")  # still this builder's rollout (not aborted)
                    added = {s: _entries_added(self.redis, tgt.log(s)) for s in tails}
                    self.registry.switch(target.name, tails)
                    gen = self.registry.get(target.name)
                    self.registry.put(replace(gen, params=dict(gen.params, switch_added=added)))
                    break
                # T's replicas are behind: writes go on to S while they catch up.
                self.registry.set_gates(src.layout, source.name)
                self.progress.message(
                    f"switch attempt {attempt}: {target.name}'s replicas did not apply "
                    f"{target.name}'s logs within {self.options.shard_wait_s:.0f} s; writes "
                    "resumed on the source"
                )
                self.registry.set_state(target.name, "catching_up")
            else:
                raise Unavailable(
                    f"{target.name}'s shard replicas did not catch up in "
                    f"{self.options.switch_attempts} attempts (are they running? "
                    f"`index generations` shows their addresses); `index rollout` again "
                    "resumes"
                )
        self.registry.set_gates(tgt.layout, target.name)
        if tgt.layout != src.layout:
            self.registry.set_gates(src.layout, CLOSED)
        # Keep every write since the switch for `index rollback` (until S is retired).
        switch_in = {int(s): p for s, p in self.registry.get(target.name).switch_in.items()}
        self._hold(tgt, switch_in, f"rollback:{source.name}", heartbeat=False)
        self._release(src, f"rollout:{target.name}")
        # The holds on S's logs for a rollback from S (to its previous, or, after a
        # rollback, to T itself): S is the previous generation now, the only target left.
        for gen in self.registry.all():
            if gen.name != source.name:
                self._release(src, f"rollback:{gen.name}")
        self._save(phase="done")

    async def _handed_over(self, target: Generation) -> None:
        """Wait, at most ``hand_over_s``, until no CPU budget holds T's processes: in the
        switch phase a local stack moves them to serving's CPUs, so that T's first
        searches do not share the budget's CPU with this builder's end. Nothing to wait
        for without a budget, or without a stack placing one (its record expires)."""
        deadline = time.monotonic() + self.options.hand_over_s
        while text(self.redis.get(CPU_PLACED_KEY) or b"") == target.name:
            if time.monotonic() > deadline:
                self.progress.message(
                    f"{target.name}'s processes are still on the rollout's CPU budget after "
                    f"{self.options.hand_over_s:.0f} s: switching anyway"
                )
                return
            await asyncio.sleep(0.05)

    # --- bulk: SCAN, encode, append -------------------------------------------------------

    def _appender(self, target: Generation) -> TargetAppender:
        tgt = self.registry.keys(target)
        src = self.registry.keys(self._source())
        return TargetAppender(self.redis, tgt, copy_documents=tgt.layout != src.layout)

    async def _encoder_for(self, target: Generation) -> Encoder:
        if self._encoder is None:
            self._encoder = await self.encoders(target.encoder)
        return self._encoder

    async def _embed(self, target: Generation, texts: Sequence[str]) -> np.ndarray:
        encoder = await self._encoder_for(target)
        step = max(1, min(encoder.max_batch, self.options.encode_batch))
        sem = asyncio.Semaphore(max(1, self.options.parallel))

        async def one(chunk: Sequence[str]) -> np.ndarray:
            async with sem:
                out = await self._encode_retrying(encoder, list(chunk))
                return np.asarray(out.vectors, dtype=np.float32)

        parts = await asyncio.gather(
            *(one(texts[i : i + step]) for i in range(0, len(texts), step))
        )
        return np.concatenate(parts) if parts else np.zeros((0, encoder.dim), np.float32)

    async def _encode_retrying(self, encoder: Encoder, texts: list[str]) -> Any:
        """``encoder.encode``, retried while the encoder is unavailable, overloaded, slow or
        failing inside (a Triton restarting, a model stub replaced) for up to
        ``encode_retry_s`` with backoff 0.5 s doubling to 10 s: a rollout of hours does not
        die of a minute's outage. Bad input is not retried."""
        deadline = time.monotonic() + self.options.encode_retry_s
        backoff = 0.5
        while True:
            try:
                timeout = self.options.encode_timeout_s
                return await encoder.encode(texts, "document", timeout=timeout)
            except (InvalidArgument, NotFound, FailedPrecondition):
                raise
            except RetrievalError as exc:
                if time.monotonic() + backoff > deadline:
                    raise
                self.progress.message(f"encoder: {exc}; again in {backoff:.1f} s")
                await asyncio.sleep(backoff)
                backoff = min(10.0, backoff * 2)

    async def _append_documents(
        self, batch: list[tuple[str, dict[bytes, bytes]]], target: Generation
    ) -> np.ndarray:
        """Encode and append SCANned documents; their vectors."""
        if not batch:
            return np.zeros((0, target.encoder.dim or 1), np.float32)
        texts = [
            embedding_text(text(d.get(b"title", b"")), text(d.get(b"text", b""))) for _, d in batch
        ]
        vectors = await self._embed(target, texts)
        items = [
            UpsertItem(
                doc_id,
                int(d.get(b"ver", b"0")),
                vectors[n],
                text(d.get(b"title", b"")),
                text(d.get(b"text", b"")),
                text(d.get(b"meta", b"{}")),
            )
            for n, (doc_id, d) in enumerate(batch)
        ]
        await asyncio.to_thread(self._appender(target).upserts, items)
        return vectors

    def _count_documents(self) -> int:
        src = self.registry.keys(self._source())
        n = 0
        for node in _nodes(self.redis):
            for key in node.scan_iter(match="doc:*", count=1000):
                n += _doc_id(key, src) is not None
        return n

    async def _scan(
        self, cursor: _ScanCursor
    ) -> AsyncIterator[tuple[list[tuple[str, dict[bytes, bytes]]], _ScanCursor]]:
        """Batches of (id, doc hash) of S's layout from ``cursor``, each with the cursor
        after it."""
        src = self.registry.keys(self._source())
        nodes = _nodes(self.redis)
        if cursor.nodes != len(nodes):
            cursor = _ScanCursor.start()  # the cluster changed: scan again (appends are idempotent)
        node_index, position = cursor.node, cursor.cursor
        while node_index < len(nodes):
            node = nodes[node_index]
            reply = await asyncio.to_thread(
                node.scan, position, match="doc:*", count=max(10, 2 * self.options.batch)
            )
            position = int(reply[0])
            ids = list(dict.fromkeys(i for i in (_doc_id(k, src) for k in reply[1]) if i))
            docs = await asyncio.to_thread(_read_docs, self.redis, src, ids)
            if position == 0:
                node_index, position = node_index + 1, 0
            after = _ScanCursor(node_index, position, len(nodes))
            yield docs, (_ScanCursor.finished() if node_index >= len(nodes) else after)

    # --- retrain: the vectors S's replicas hold ------------------------------------------

    async def _export_all(self, target: Generation) -> np.ndarray:
        """Append every vector S's replicas hold (version 0) and return a reservoir sample."""
        exporter: Exporter
        if self.exporter is None:
            from services.index.client.export import export_vectors

            exporter = functools.partial(export_vectors, tls=self.shard_tls)
        else:
            exporter = self.exporter
        source = self._source()
        spec = self.registry.addresses(source.name) or self.source_addresses
        if not spec:
            raise FailedPrecondition(
                f"--retrain: {source.name}'s shard addresses are unknown ({{gtr}}:addrs has "
                "none; give --source-shards)"
            )
        from services.index.rollout.replicas import parse_addresses

        shards = parse_addresses(spec)
        p0 = {int(s): p for s, p in json.loads(self._state["p0"]).items()}
        src = self.registry.keys(source)
        appender = self._appender(target)
        rng = np.random.default_rng(1234)
        sample: list[np.ndarray] = []
        seen = 0
        total = self._count_documents()
        self.progress.total(total)
        for shard, replicas in enumerate(shards):
            position = await self._export_shard(
                exporter, replicas, shard, p0[shard], src, appender, sample, rng, seen
            )
            seen = position
        dim = target.encoder.dim or (sample[0].shape[0] if sample else 0)
        return np.stack(sample) if sample else np.zeros((0, dim), np.float32)

    async def _export_shard(
        self,
        exporter: Exporter,
        replicas: list[str],
        shard: int,
        p0: str,
        src: GenerationKeys,
        appender: TargetAppender,
        sample: list[np.ndarray],
        rng: np.random.Generator,
        seen: int,
    ) -> int:
        deadline = time.monotonic() + self.options.shard_wait_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            for address in replicas:
                try:
                    count = seen
                    async for ids, vectors, position in exporter(address):
                        if not positions.at_least(position or positions.ZERO, p0):
                            raise _Behind(f"{address} applied {position}, P0 is {p0}")
                        docs = dict(await asyncio.to_thread(_read_docs, self.redis, src, ids))
                        items = []
                        for n, doc_id in enumerate(ids):
                            d = docs.get(doc_id)
                            if d is None:
                                continue  # deleted since: the replay appends the delete
                            items.append(
                                UpsertItem(
                                    doc_id,
                                    RETRAIN_VERSION,
                                    vectors[n],
                                    text(d.get(b"title", b"")),
                                    text(d.get(b"text", b"")),
                                    text(d.get(b"meta", b"{}")),
                                )
                            )
                            count += 1
                            if len(sample) < self.options.sample:
                                sample.append(np.asarray(vectors[n], np.float32))
                            else:
                                j = int(rng.integers(0, count))
                                if j < self.options.sample:
                                    sample[j] = np.asarray(vectors[n], np.float32)
                        for i in range(0, len(items), 256):
                            await asyncio.to_thread(appender.upserts, items[i : i + 256])
                        self.progress.advance(len(ids))
                    return count
                except _Behind as exc:
                    last_error = exc
                except (Unavailable, OSError) as exc:
                    last_error = exc
                    await self._check_transport(address)
            await asyncio.sleep(0.5)
        hint = ""
        if self.shard_tls is not None and not self.shard_tls.cert:
            hint = (
                ": if the replicas require client certificates (mTLS, as under `up --tls`), "
                "give --tls-client-cert and --tls-client-key"
            )
        raise Unavailable(
            f"--retrain: no replica of {src.name}'s shard {shard} exported its vectors at or "
            f"past P0 within {self.options.shard_wait_s:.0f} s ({last_error}){hint}"
        )

    async def _check_transport(self, address: str) -> None:
        """FailedPrecondition at once when the replica at ``address`` speaks TLS and the
        builder talks plaintext to it, or the other way round (gRPC says only "Socket
        closed", and waiting does not help); checked once per replica."""
        if address in self._probed:
            return
        from services.common.tls import speaks_tls

        tls = await asyncio.to_thread(speaks_tls, address)
        if tls is None:
            return  # not reachable (down, starting): the wait goes on
        self._probed.add(address)
        if tls and self.shard_tls is None:
            raise FailedPrecondition(
                f"shard replica {address} speaks TLS and the rollout reaches the replicas in "
                "plaintext: give --tls-ca (and --tls-client-cert and --tls-client-key when "
                "they require client certificates, as under `up --tls`), or --run-dir of "
                "the local stack"
            )
        if not tls and self.shard_tls is not None:
            raise FailedPrecondition(
                f"shard replica {address} speaks plaintext and the rollout reaches the "
                "replicas over TLS (--tls-ca): drop the --tls-* flags"
            )

    # --- replay ---------------------------------------------------------------------------

    async def _replay(self, until: dict[int, str] | None) -> int:
        """Replay S's logs from the saved positions: to their tails now (``until`` None:
        one pass), or to ``until`` exactly; the number of entries replayed."""
        source, target = self._source(), self._target()
        src = self.registry.keys(source)
        done = {int(s): p for s, p in json.loads(self._state["positions"]).items()}
        replayed = _counts(self._state.get("replayed", "{}"))
        appender = self._appender(target)
        count = 0
        for shard in range(src.num_shards):
            key = src.log(shard)
            end = until[shard] if until is not None else _last_id(self.redis, key)
            position = done.get(shard, positions.ZERO)
            if _trimmed_past(self.redis, key, position):
                raise FailedPrecondition(
                    f"{key} was trimmed past {position} (the builder was gone longer than "
                    "the shards' stale-replica time?): writes since cannot be replayed; "
                    "`index rollout --abort` and start again"
                )
            while positions.compare(position, end) < 0:
                entries = await asyncio.to_thread(
                    self.redis.xrange, key, f"({position}", end, self.options.batch
                )
                if not entries:
                    break
                await self._replay_entries(entries, src, target, appender)
                position = text(entries[-1][0])
                done[shard] = position
                replayed[shard] = replayed.get(shard, 0) + len(entries)
                count += len(entries)
                self._save(positions=_j(done), replayed=_j(replayed))
                self._hold(src, {shard: position}, f"rollout:{target.name}")
                self.progress.advance(len(entries))
                lag = self._lag()
                if lag is not None:
                    self.progress.lag(lag)
        return count

    async def _replay_entries(
        self, entries: list[Any], src: GenerationKeys, target: Generation, appender: TargetAppender
    ) -> None:
        """Append a batch of S's entries in order (their upserts re-embedded together)."""
        parsed = [_parse_entry(fields) for _, fields in entries]
        need: list[tuple[int, int]] = []  # (entry, row) of the upserts whose text is missing
        for e, entry in enumerate(parsed):
            if entry.op == "u" and entry.texts is None:
                docs = dict(_read_docs(self.redis, src, entry.ids))
                for n, doc_id in enumerate(entry.ids):
                    d = docs.get(doc_id)
                    if d is not None and int(d.get(b"ver", b"0")) == entry.versions[n]:
                        entry.rows[n] = (text(d.get(b"title", b"")), text(d.get(b"text", b"")))
                    else:
                        need.append((e, n))  # a newer version follows in the log
        texts = [embedding_text(*row) for entry in parsed if entry.op == "u" for row in entry.rows]
        vectors = await self._embed(target, texts) if texts else None
        k = 0
        for e, entry in enumerate(parsed):
            if entry.op == "d":
                await asyncio.to_thread(
                    appender.deletes,
                    [DeleteItem(i, v) for i, v in zip(entry.ids, entry.versions, strict=True)],
                )
                continue
            assert vectors is not None
            items = []
            for n, doc_id in enumerate(entry.ids):
                row = vectors[k]
                k += 1
                if (e, n) in need:
                    continue
                title, body = entry.rows[n]
                items.append(
                    UpsertItem(doc_id, entry.versions[n], row, title, body, entry.metas[n])
                )
            await asyncio.to_thread(appender.upserts, items)

    def _lag(self) -> int | None:
        """Entries of S's logs not yet replayed (from Redis's count of entries added);
        None when the count at the start is unknown (a rollback to a generation switched
        away from before that count was recorded)."""
        src = self.registry.keys(self._source())
        added0 = _counts(self._state.get("added0", "{}"))
        replayed = _counts(self._state.get("replayed", "{}"))
        if not added0:
            return None
        return sum(
            max(0, _entries_added(self.redis, src.log(s)) - added0.get(s, 0) - replayed.get(s, 0))
            for s in range(src.num_shards)
        )

    # --- T's replicas ---------------------------------------------------------------------

    async def _target_applied(self, target: Generation, tails: dict[int, str]) -> bool:
        """True once every replica of T's shards applied ``tails`` (or, without waiting
        for shards, at once)."""
        if not self.options.wait_for_shards:
            return True
        deadline = time.monotonic() + self.options.shard_wait_s
        while time.monotonic() < deadline:
            spec = self.registry.addresses(target.name)
            if spec:
                applied = await self._applied(spec)
                if len(applied) == len(tails) and all(
                    replicas
                    and all(p is not None and positions.at_least(p, tails[s]) for p in replicas)
                    for s, replicas in enumerate(applied)
                ):
                    return True
            await asyncio.sleep(0.2)
        return False

    async def _applied(self, spec: str) -> list[list[str | None]]:
        if self.applied is not None:
            return await self.applied(spec)
        from services.index.rollout.replicas import all_stats, parse_addresses

        out: list[list[str | None]] = []
        shards = parse_addresses(spec)
        for addresses, replicas in zip(shards, await all_stats(spec, self.shard_tls), strict=True):
            for address, r in zip(addresses, replicas, strict=True):
                if isinstance(r, Unavailable):
                    await self._check_transport(address)
            out.append([getattr(r, "applied", None) for r in replicas])
        return out

    # --- holds on a generation's logs ------------------------------------------------------

    def _hold(
        self, keys: GenerationKeys, at: dict[int, str], name: str, heartbeat: bool = True
    ) -> None:
        """Keep ``keys``' shards from trimming their logs past ``at`` (registered like a
        replica's snapshot; without ``heartbeat`` it never goes stale)."""
        now = repr(time.time())
        for shard, position in at.items():
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(keys.snapshots(shard), name, position)
            if heartbeat:
                pipe.hset(keys.replicas_seen(shard), name, now)
            pipe.execute()

    def _release(self, keys: GenerationKeys, name: str) -> None:
        for shard in range(keys.num_shards):
            self.redis.hdel(keys.snapshots(shard), name)
            self.redis.hdel(keys.replicas_seen(shard), name)


# --- helpers ---------------------------------------------------------------------------------


class _Behind(Exception):
    pass


@dataclass(frozen=True)
class _ScanCursor:
    node: int
    cursor: int
    nodes: int
    finished_: bool = False

    @classmethod
    def start(cls) -> _ScanCursor:
        return cls(0, 0, 0)

    @classmethod
    def finished(cls) -> _ScanCursor:
        return cls(0, 0, 0, True)

    def dump(self) -> str:
        return _j(
            {
                "node": self.node,
                "cursor": self.cursor,
                "nodes": self.nodes,
                "finished": self.finished_,
            }
        )

    @classmethod
    def load(cls, raw: str) -> _ScanCursor:
        if not raw:
            return cls.start()
        d = json.loads(raw)
        return cls(int(d["node"]), int(d["cursor"]), int(d["nodes"]), bool(d["finished"]))


@dataclass
class _Entry:
    op: str
    ids: list[str]
    versions: list[int]
    rows: list[tuple[str, str]]
    metas: list[str]
    texts: list[str] | None


def _parse_entry(fields: dict[bytes, bytes]) -> _Entry:
    ids = [str(i) for i in json.loads(fields[b"ids"])]
    if b"vers" in fields:
        versions = [int(v) for v in json.loads(fields[b"vers"])]
    else:
        versions = [int(fields.get(b"ver", b"0"))] * len(ids)
    if fields[b"op"] == b"d":
        return _Entry("d", ids, versions, [], [], [])
    titles = json.loads(fields[b"titles"]) if b"titles" in fields else None
    texts = json.loads(fields[b"texts"]) if b"texts" in fields else None
    tags = json.loads(fields.get(b"tags", b"null")) or [{}] * len(ids)
    rows = list(zip(titles or [""] * len(ids), texts or [""] * len(ids), strict=True))
    metas = [json.dumps(t, sort_keys=True) for t in tags]
    return _Entry("u", ids, versions, rows, metas, texts)


def _nodes(client: Any) -> list[Any]:
    """One blocking client per primary (a single Redis: itself)."""
    if hasattr(client, "get_primaries"):
        primaries = sorted(client.get_primaries(), key=lambda n: n.name)
        return [client.get_redis_connection(n) for n in primaries]
    return [client]


def _doc_id(key: bytes | str, keys: GenerationKeys) -> str | None:
    """The id of a ``doc:`` key of ``keys``' layout, None for another layout's."""
    k = text(key)
    end = k.find("}:")
    if not k.startswith("doc:{") or end < 0:
        return None
    tag = k[4 : end + 1]
    doc_id = k[end + 2 :]
    layout = keys.layout
    return doc_id if layout.tag(layout.shard(doc_id)) == tag else None


def _read_docs(
    client: Any, keys: GenerationKeys, ids: Sequence[str]
) -> list[tuple[str, dict[bytes, bytes]]]:
    if not ids:
        return []
    pipe = client.pipeline(transaction=False)
    for doc_id in ids:
        pipe.hgetall(keys.layout.doc(doc_id))
    return [(i, d) for i, d in zip(ids, pipe.execute(), strict=True) if d]


def _last_id(client: Any, key: str) -> str:
    """The stream's last generated id (``0-0`` for none): every entry ever added to it is
    at or before it, trimmed or not."""
    import redis

    try:
        info = client.xinfo_stream(key)
    except redis.ResponseError:
        return positions.ZERO
    return text(info["last-generated-id"])


def _entries_added(client: Any, key: str) -> int:
    import redis

    try:
        info = client.xinfo_stream(key)
    except redis.ResponseError:
        return 0
    return int(info.get("entries-added", info["length"]))


def _trimmed_past(client: Any, key: str, position: str) -> bool:
    """True when entries after ``position`` may have been trimmed from ``key`` (as
    :meth:`services.index.changelog.LogReader.trimmed_past`: XTRIM removes the oldest
    entries only, so a position before the first entry left, on a stream that lost
    entries, cannot be replayed)."""
    import redis

    try:
        info = client.xinfo_stream(key)
    except redis.ResponseError:
        return False
    if int(info.get("entries-added", info["length"])) - int(info["length"]) <= 0:
        return False
    first = info.get("first-entry")
    oldest_kept = text(first[0]) if first else text(info["last-generated-id"])
    return positions.compare(position, oldest_kept) < 0


def _counts(raw: str) -> dict[int, int]:
    return {int(s): int(n) for s, n in json.loads(raw).items()}


def _manifest(index_dir: str) -> dict[str, Any]:
    try:
        return dict(json.loads((Path(index_dir) / "manifest.json").read_text()))
    except (OSError, ValueError):
        return {}
