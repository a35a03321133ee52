"""Which index generation answers a request: the alias, cached, and each generation's
parts (issue #24; the design: docs/generations.md).

Every request is served wholly by one generation: its encoder (Triton model version), its
shards, its layout's documents, its logs. :class:`GenerationSource` holds the alias
(``{gtr}:alias``: serving generation and epoch) and answers :meth:`~GenerationSource.current`
from memory: a search costs no Redis round trip for it, only an attribute read. The alias
is read again

* every ``refresh_s`` (``--alias-refresh-ms``, 500 ms) in the background, every
  ``SWITCH_REFRESH_S`` (50 ms) while the rollout's target is ``switching`` (the alias is
  about to move), and
* at once (:meth:`~GenerationSource.refresh`, concurrent callers share one read) when a
  write finds its writer gate moved (``GenerationMoved``) or a write token names a newer
  epoch than the cached one, and by a read begun after it arrived
  (:meth:`~GenerationSource.fresh`) for a STRONG search.

A generation's parts (:class:`Bundle`: encoder, shard router, document reader, log tails,
writer) are built by an injected factory and warmed (:func:`warm`: one query through its
encoder and shards) before requests use them: a rollout's target as soon as it catches
up (:meth:`~GenerationSource.prepare_target`, on each background refresh), so the switch
only swaps a reference (a switch and a preparation share one build of a generation's
parts, whichever begins it, and a switch waits for the warm-up at most
``WARM_INLINE_S``); otherwise the first time the alias names it, before the alias is
swapped (requests keep the old generation until the new one can serve). They are kept
while the alias names it as serving or previous (a rollback finds them ready) or the
rollout names it as its target. A
generation the alias no longer names (retired, or two switches away) is closed once the
requests that hold it (:meth:`~GenerationSource.lease`) have finished.

Write tokens keep their meaning across a switch
(:func:`~services.gateway.generation_parts.resolve_token`): a token of the serving epoch
is read as it is; one of an older epoch is covered by the serving generation's
``switch_in`` positions (every write acknowledged before its switch is in them), plus its
own positions when it names the serving generation (a rollback serves the same logs
again); a token of a newer epoch than the store has reached is refused.

No grpc here: the factory that builds bundles from the real clients is the server's
(:mod:`services.gateway.server`), and the registry is read through
:class:`AliasReader`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from services.common import timeouts
from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.gateway.dual_write import DualWrites, EncoderFactory
from services.gateway.generation_parts import (
    AliasReader,
    Bundle,
    BundleFactory,
    NoEvents,
    Serving,
    SourceEvents,
    warm,
)
from services.generations.registry import Generation

log = logging.getLogger(__name__)

# How often the alias is read in the background (GatewaySettings.alias_refresh_ms).
DEFAULT_REFRESH_S = 0.5
# ... and every SWITCH_REFRESH_S while the rollout's target is switching: the alias is
# about to move, and every search until the gateway sees it is served by the old generation.
SWITCH_REFRESH_S = 0.05
# A rollout target is warmed (:func:`warm`) in the background for at most this long; a
# generation met first at a switch (not prepared: a gateway started mid-rollout) for at
# most WARM_INLINE_S, since requests that re-read the alias wait on that read.
WARM_S = 2.0
WARM_INLINE_S = 0.25
# A rollout target in one of these states is built and warmed before its switch.
PREPARED_STATES = ("catching_up", "switching")


class GenerationSource:
    """The serving generation of each request (see the module's docstring)."""

    def __init__(
        self,
        reader: AliasReader | None,
        build: BundleFactory | None,
        *,
        refresh_s: float = DEFAULT_REFRESH_S,
        events: SourceEvents | None = None,
        encoders: EncoderFactory | None = None,
    ) -> None:
        if refresh_s <= 0:
            raise ValueError("refresh_s must be positive")
        self._reader = reader
        self._build = build
        # the dual write (services/gateway/dual_write.py), decided on each refresh;
        # ``encoders`` builds a generation's encoder alone (None: no dual write)
        self.dual = DualWrites(encoders)
        self._serving_record: Generation | None = None
        self.refresh_s = refresh_s
        self._events: SourceEvents = events if events is not None else NoEvents()
        self._target = ""  # the rollout's target, as last read (its parts are kept)
        self._serving: Serving | None = None
        self._bundles: dict[str, Bundle] = {}
        self._refreshing: asyncio.Task[Serving] | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._preparing: asyncio.Task[None] | None = None  # a rollout target's parts
        # the one build in flight per generation, shared by a switch and a preparation
        self._building: dict[str, asyncio.Task[Bundle]] = {}
        self._switching_to = ""  # the generation a refresh is getting ready to serve
        self._switch_near = False  # the rollout's target is switching: read the alias often
        self._wake = asyncio.Event()  # ends the background loop's sleep early
        self._stopping = False  # closed: the background loop ends at its next turn
        self._closing: set[asyncio.Task[None]] = set()
        self._warms: set[asyncio.Task[None]] = set()  # warm-ups running
        self._last_error = self._prepare_error = ""  # each logged once while it repeats

    @classmethod
    def fixed(cls, bundle: Bundle, epoch: int = 1) -> GenerationSource:
        """One generation and no registry (a pipeline in a test, a tool over one store):
        :meth:`refresh` answers the same."""
        source = cls(None, None)
        source._bundles[bundle.name] = bundle
        source._serving = Serving(bundle.name, epoch, bundle)
        return source

    # --- reading ------------------------------------------------------------------------

    def current(self) -> Serving:
        """The alias as last read, from memory (no I/O)."""
        if self._serving is None:
            raise FailedPrecondition("the gateway has not read the generations alias yet")
        return self._serving

    async def refresh(self) -> Serving:
        """Read the alias now (one read shared by every concurrent caller); a generation
        it names for the first time is built before it serves."""
        if self._reader is None:
            return self.current()
        task = self._refreshing
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._refresh_once())
            self._refreshing = task
        # shielded: a caller whose deadline ends does not cancel the others' read
        return await asyncio.shield(task)

    async def fresh(self) -> Serving:
        """The alias as read by a read that began after this call: what a STRONG read is
        served by (a read already in flight may predate a switch the client has seen, and
        the cached alias lags a switch by up to ``refresh_s``)."""
        if self._reader is None:
            return self.current()
        task = self._refreshing
        if task is not None and not task.done():
            with contextlib.suppress(Exception):  # its outcome is not ours to report
                await asyncio.shield(task)
        return await self.refresh()  # joins only a read begun after the one above

    async def at_least(self, epoch: int) -> Serving:
        """The serving generation, re-read first when ``epoch`` is newer than the cached
        alias's (a token taken after a switch this gateway has not seen yet)."""
        serving = self.current()
        # Twice at most: the first may join a read that began before the token's switch.
        for _ in range(2):
            if epoch <= serving.epoch:
                break
            serving = await self.refresh()
        return serving

    @contextlib.contextmanager
    def lease(self, serving: Serving) -> Iterator[Bundle]:
        """Hold ``serving``'s parts for one request: a generation retired meanwhile is
        closed only after its last request."""
        bundle = serving.bundle
        bundle.users += 1
        try:
            yield bundle
        finally:
            bundle.users -= 1
            if bundle.retired and bundle.users == 0:
                self._close_later(bundle)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> Serving:
        """Read the alias, build the serving generation's parts, refresh in the background."""
        serving = await self.refresh()
        if self._reader is not None and self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._refresh_loop())
        return serving

    async def close(self) -> None:
        """Stop the background refresh, then close every generation's parts. A cancel the
        loop lost (Redis's client can lose one on Python 3.11) only costs it one tick: it
        stops at its next turn. A cancellation of the caller is never swallowed here."""
        self._stopping = True
        self._wake.set()
        tasks: list[asyncio.Task[object]] = [
            *(t for t in (self._loop_task, self._refreshing, self._preparing) if t),
            *self._building.values(),
            *self._warms,
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop_task = None
        await self.dual.close()
        for bundle in list(self._bundles.values()):
            await bundle.close()
        self._bundles.clear()
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)

    def bundles(self) -> dict[str, Bundle]:
        """The generations whose parts are open now (by name)."""
        return dict(self._bundles)

    # --- inside -------------------------------------------------------------------------

    async def _refresh_once(self) -> Serving:
        assert self._reader is not None and self._build is not None
        alias = await self._reader.alias()
        if alias is None:
            if self._serving is not None:
                return self._serving
            raise FailedPrecondition(
                "no generation serves yet ({gtr}:alias is empty): the gateway records g1 at start"
            )
        current = self._serving
        if current is not None and (current.generation, current.epoch) == (
            alias.serving,
            alias.epoch,
        ):
            return current
        record = await self._reader.generation(alias.serving)
        self._switching_to = record.name  # kept open by any retirement meanwhile
        try:
            bundle = await self._parts(record, warm_s=WARM_INLINE_S if current else 0.0)
        finally:
            self._switching_to = ""
        serving = Serving(
            record.name,
            alias.epoch,
            bundle,
            {int(s): p for s, p in record.switch_in.items()},
            alias.previous,
            record.retrieval,
        )
        self._serving, self._serving_record = serving, record
        if current is None or current.generation != serving.generation:
            log.info(
                "generation %s serves (alias epoch %d, previous %s)",
                serving.generation,
                serving.epoch,
                serving.previous or "none",
            )
        self._events.serving(serving.generation, serving.epoch, bundle.encoder.model_name)
        self._retire_others({alias.serving, alias.previous or "", self._target})
        return serving

    async def prepare_target(self, wait: bool = True) -> None:
        """Build and warm the parts of the generation a rollout is about to switch to
        (state ``switching``, or ``catching_up`` with its shards' addresses recorded),
        off the request path: at the switch the gateway only swaps a reference. A target
        that cannot be built yet is tried again on the next refresh; one the rollout no
        longer names is closed like any generation the alias does not name.
        ``wait=False`` (the background refresh): build and warm-up (up to WARM_S) run in
        a task of their own, so a switch during a slow warm-up is seen at the next tick."""
        assert self._reader is not None and self._build is not None
        target = await self._reader.rollout_target() or ""
        dropped, self._target = self._target, target
        if dropped and dropped != target:  # aborted, or switched
            self._retire_current()
        record: Generation | None = None
        if target:
            try:
                record = await self._reader.generation(target)
            except NotFound:  # `index rollout --encoder` publishing: the record comes after
                record = None
        await self.dual.update(self._serving_record, record)
        near = record is not None and record.state == "switching"
        if near and not self._switch_near:
            self._wake.set()  # the loop's next read comes now, not at the end of its sleep
        self._switch_near = near
        if record is None or target in self._bundles or record.state not in PREPARED_STATES:
            return
        if self._preparing is None or self._preparing.done():
            self._preparing = asyncio.get_running_loop().create_task(self._prepare(record))
            if not wait:
                self._preparing.add_done_callback(self._prepared)
        if wait:
            await asyncio.shield(self._preparing)

    async def _parts(self, record: Generation, warm_s: float) -> Bundle:
        """``record``'s parts for a switch to it: the ones open (a prepared target waited
        for while its warm-up runs, at most ``warm_s``), else the one build of them (a
        background preparation's in flight, or begun here) and warmed for at most
        ``warm_s`` (0: the gateway's start, nothing is served yet)."""
        bundle = self._bundles.get(record.name)
        if bundle is None:
            bundle = await self._built(record)
            if warm_s <= 0:
                bundle.warmed.set()
        if warm_s > 0 and not bundle.warmed.is_set():
            if not bundle.warming:
                self._warm_later(bundle, warm_s)
            with contextlib.suppress(TimeoutError):
                await timeouts.wait_for(bundle.warmed.wait(), warm_s)
        return bundle

    async def _built(self, record: Generation) -> Bundle:
        """``record``'s parts, built once and kept as that generation's: a switch and a
        background preparation that both want them share the build in flight (whichever
        began it), and neither's cancellation stops it for the other."""
        name = record.name
        task = self._building.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._build_and_keep(record))
            self._building[name] = task

            def done(finished: asyncio.Task[Bundle]) -> None:
                if self._building.get(name) is finished:
                    del self._building[name]

            task.add_done_callback(done)
        return await asyncio.shield(task)

    async def _build_and_keep(self, record: Generation) -> Bundle:
        assert self._build is not None
        built = await self._build(record)
        bundle = self._bundles.setdefault(record.name, built)
        if bundle is not built:  # parts of it opened meanwhile by other means
            await built.close()
        return bundle

    def _warm_later(self, bundle: Bundle, timeout_s: float) -> asyncio.Task[None]:
        """Warm ``bundle`` (:func:`warm`, up to ``timeout_s``) in a task of its own, once;
        its ``warmed`` event is set when that ends."""

        async def warming() -> None:
            try:
                await warm(bundle, timeout_s)
            finally:
                bundle.warmed.set()

        bundle.warming = True
        task = asyncio.get_running_loop().create_task(warming())
        self._warms.add(task)
        task.add_done_callback(self._warms.discard)
        return task

    async def _prepare(self, record: Generation) -> None:
        """Build (or join the build in flight of) ``record``'s parts and warm them (up to
        WARM_S), so a switch only swaps a reference; they are kept as soon as they are
        built. Parts the rollout no longer names once built are retired."""
        target = record.name
        try:
            bundle = await self._built(record)
        except (Unavailable, FailedPrecondition) as exc:  # its shards are not up yet
            log.debug("generation %s cannot be prepared yet: %s", target, exc)
            return
        if self._target != target:  # the rollout moved on while it was built
            self._retire_current()
            return
        if not bundle.warming and not bundle.warmed.is_set():
            await self._warm_later(bundle, WARM_S)
        log.info("generation %s (%s) prepared for its switch", target, record.state)

    def _prepared(self, task: asyncio.Task[None]) -> None:
        """A background preparation's failure, reported with a last error of its own."""
        error = None if task.cancelled() else task.exception()
        self._prepare_error = "" if error is None else self._report(error, self._prepare_error)

    def _retire_current(self) -> None:
        """Retire every generation neither the alias nor the rollout names."""
        serving = self._serving
        if serving is not None:
            self._retire_others({serving.generation, serving.previous or "", self._target})

    def _retire_others(self, keep: set[str]) -> None:
        keep = keep | {self._switching_to}
        for name in [n for n in self._bundles if n not in keep]:
            bundle = self._bundles.pop(name)
            bundle.retired = True
            log.info("generation %s is no longer named by the alias: closing its parts", name)
            if bundle.users == 0:
                self._close_later(bundle)

    def _close_later(self, bundle: Bundle) -> None:
        task = asyncio.get_running_loop().create_task(bundle.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _refresh_loop(self) -> None:
        while not self._stopping:
            interval = (
                min(self.refresh_s, SWITCH_REFRESH_S) if self._switch_near else self.refresh_s
            )
            with contextlib.suppress(TimeoutError):
                await timeouts.wait_for(self._wake.wait(), interval)
            self._wake.clear()
            if self._stopping:
                return
            try:
                await self.refresh()
                await self.prepare_target(wait=False)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._last_error = self._report(exc, self._last_error)
            else:
                self._last_error = ""

    def _report(self, exc: BaseException, last: str) -> str:
        """Count a failed refresh; log it unless it repeats ``last``; its message."""
        self._events.refresh_failed()
        message = f"{type(exc).__name__}: {exc}"
        if message != last:
            log.warning(
                "reading the generations alias failed (serving %s as before): %s",
                self._serving.generation if self._serving else "nothing",
                message,
            )
        return message
