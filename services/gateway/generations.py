"""Which index generation answers a request: the alias, cached, and each generation's
parts (issue #24; the design: docs/generations.md).

Every request is served wholly by one generation: its encoder (Triton model version), its
shards, its layout's documents, its logs. :class:`GenerationSource` holds the alias
(``{gtr}:alias``: serving generation and epoch) and answers :meth:`~GenerationSource.current`
from memory: a search costs no Redis round trip for it, only an attribute read. The alias
is read again

* every ``refresh_s`` (``--alias-refresh-ms``, 500 ms) in the background, and
* at once (:meth:`~GenerationSource.refresh`, concurrent callers share one read) when a
  write finds its writer gate moved (``GenerationMoved``) or a write token names a newer
  epoch than the cached one, and by a read begun after it arrived
  (:meth:`~GenerationSource.fresh`) for a STRONG search.

A generation's parts (:class:`Bundle`: encoder, shard router, document reader, log tails,
writer) are built by an injected factory and warmed (:func:`warm`: one query through its
encoder and shards) before requests use them: a rollout's target as soon as it catches
up (:meth:`~GenerationSource.prepare_target`, on each background refresh), so the switch
only swaps a reference; otherwise the first time the alias names it, before the alias is
swapped (requests keep the old generation until the new one can serve). They are kept
while the alias names it as serving or previous (a rollback finds them ready) or the
rollout names it as its target. A
generation the alias no longer names (retired, or two switches away) is closed once the
requests that hold it (:meth:`~GenerationSource.lease`) have finished.

Write tokens keep their meaning across a switch (:func:`resolve_token`): a token of the
serving epoch is read as it is; one of an older epoch is covered by the serving
generation's ``switch_in`` positions (every write acknowledged before its switch is in
them), plus its own positions when it names the serving generation (a rollback serves
the same logs again); a token of a newer epoch than the store has reached is refused.

No grpc here: the factory that builds bundles from the real clients is the server's
(:mod:`services.gateway.server`), and the registry is read through
:class:`AliasReader`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.common.domain import TokenOrigin, WriteToken
from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.common.retrieval_setting import RetrievalSetting
from services.gateway.dual_write import DualWrites, EncoderFactory
from services.gateway.ports import (
    DocumentStore,
    DocumentWriter,
    Encoder,
    IndexQuery,
    LogTails,
    VectorIndex,
)
from services.generations import tokens
from services.generations.registry import Alias, Generation, read_alias, read_generation
from services.index.client.connection import REDIS_ERRORS
from services.index.keys import ROLLOUT_KEY

log = logging.getLogger(__name__)

# How often the alias is read in the background (GatewaySettings.alias_refresh_ms).
DEFAULT_REFRESH_S = 0.5
# A rollout target is warmed (:func:`warm`) in the background for at most this long; a
# generation met first at a switch (not prepared: a gateway started mid-rollout) for at
# most WARM_INLINE_S, since requests that re-read the alias wait on that read.
WARM_S = 2.0
WARM_INLINE_S = 0.25
WARM_QUERY = "warm up"
# A rollout target in one of these states is built and warmed before its switch.
PREPARED_STATES = ("catching_up", "switching")


async def warm(bundle: Bundle, timeout_s: float) -> bool:
    """One query through a generation's encoder and shards before it serves: connects the
    gateway's channels to its shards and Triton version and runs their first calls, which
    cost tens of milliseconds more than later ones (``bench.rollout`` saw the searches at a
    switch go from ~45 to ~175 ms p99 without it). Bounded by ``timeout_s``; a failure is
    logged, never raised: the generation serves anyway, as it would have unwarmed."""
    try:
        async with asyncio.timeout(timeout_s):
            embedded = await bundle.encoder.encode([WARM_QUERY], "query", timeout=timeout_s)
            await bundle.index.search(IndexQuery(embedded.vectors, 1), timeout_s)
        return True
    except Exception as exc:
        log.info("warming generation %s failed (it serves unwarmed): %s", bundle.name, exc)
        return False


def encoder_identity(encoder: Encoder) -> str:
    """What decides a query's embedding besides its text: the model, and the Triton
    version and digest when the encoder has them (the query cache keys on this, so two
    generations of one encoder share their cached embeddings and two encoders never do)."""
    version = int(getattr(encoder, "model_version", 0) or 0)
    digest = str(getattr(encoder, "digest", "") or "")
    ident = encoder.model_name
    if version:
        ident += f"@{version}"
    if digest:
        ident += f"#{digest}"
    return ident


@dataclass(eq=False)
class Bundle:
    """One generation's parts, as a request uses them. ``owned``: what closing the
    bundle closes (an encoder shared with other generations is not in it)."""

    name: str
    encoder: Encoder
    index: VectorIndex
    documents: DocumentStore
    tails: LogTails
    writer: DocumentWriter
    owned: Sequence[Any] = ()
    users: int = 0
    retired: bool = False
    closed: bool = False
    encoder_id: str = ""

    def __post_init__(self) -> None:
        if not self.encoder_id:
            self.encoder_id = encoder_identity(self.encoder)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for part in reversed(list(self.owned)):
            close = getattr(part, "close", None)
            if close is None:
                continue
            try:
                result = close()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # one part failing to close must not keep the others open
                log.exception("closing %r of generation %s", part, self.name)


@dataclass(frozen=True)
class Serving:
    """The alias as this gateway knows it, with the serving generation's parts."""

    generation: str
    epoch: int
    bundle: Bundle
    # the serving generation's log positions at its switch-in, by shard (docs/generations.md)
    switch_in: WriteToken = field(default_factory=dict)
    previous: str | None = None
    # the serving generation's retrieval setting (its record's; None: the gateway's flags)
    setting: RetrievalSetting | None = None

    @property
    def origin(self) -> TokenOrigin:
        """What a write acknowledged now carries in its token."""
        return TokenOrigin(self.generation, self.epoch)


def resolve_token(token: WriteToken, origin: TokenOrigin, serving: Serving) -> WriteToken:
    """The positions in ``serving``'s logs that a SESSION search with ``token`` (taken in
    ``origin``) must wait for: :func:`services.generations.tokens.resolve_token` (the rule)
    with this gateway's cached alias."""
    return tokens.resolve_token(
        token,
        origin,
        generation=serving.generation,
        epoch=serving.epoch,
        switch_in=serving.switch_in,
    )


class AliasReader(Protocol):
    """The registry as the gateway reads it (async; :class:`RedisAliasReader`)."""

    async def alias(self) -> Alias | None: ...

    async def generation(self, name: str) -> Generation: ...

    async def rollout_target(self) -> str | None:
        """The generation a running rollout builds (None: no rollout)."""
        ...


class RedisAliasReader:
    """:class:`AliasReader` over the gateway's async Redis (or Redis Cluster) client; a
    Redis that cannot be reached is Unavailable (a write re-reading the alias then fails
    as its write would, safe to retry)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def alias(self) -> Alias | None:
        try:
            return await read_alias(self.client)
        except REDIS_ERRORS as exc:
            raise Unavailable(f"redis: reading the generations alias: {exc}") from exc

    async def generation(self, name: str) -> Generation:
        try:
            return await read_generation(self.client, name)
        except REDIS_ERRORS as exc:
            raise Unavailable(f"redis: reading generation {name}: {exc}") from exc

    async def rollout_target(self) -> str | None:
        try:
            raw = await self.client.hget(ROLLOUT_KEY, "target")
        except REDIS_ERRORS as exc:
            raise Unavailable(f"redis: reading the rollout: {exc}") from exc
        return (raw.decode() if isinstance(raw, bytes) else raw) or None


BundleFactory = Callable[[Generation], Awaitable[Bundle]]


class SourceEvents(Protocol):
    """What the source reports (the gateway's metrics; :class:`NoEvents` by default)."""

    def serving(self, generation: str, epoch: int, model: str) -> None:
        """``generation`` serves at ``epoch``; ``model``: its encoder's model name."""

    def refresh_failed(self) -> None: ...


class NoEvents:
    def serving(self, generation: str, epoch: int, model: str) -> None:
        pass

    def refresh_failed(self) -> None:
        pass


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
        self._closing: set[asyncio.Task[None]] = set()
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
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        for task in (self._refreshing, self._preparing):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
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
        bundle = self._bundles.get(record.name)
        if bundle is None:
            bundle = await self._build(record)
            if current is not None:  # a switch: the first searches must not be the cold ones
                await warm(bundle, WARM_INLINE_S)
            self._bundles[record.name] = bundle
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
        serving = self._serving
        if dropped and dropped != target and serving is not None:  # aborted, or switched
            self._retire_others({serving.generation, serving.previous or "", target})
        record: Generation | None = None
        if target:
            try:
                record = await self._reader.generation(target)
            except NotFound:  # `index rollout --encoder` publishing: the record comes after
                record = None
        await self.dual.update(self._serving_record, record)
        if record is None or target in self._bundles or record.state not in PREPARED_STATES:
            return
        if self._preparing is None or self._preparing.done():
            self._preparing = asyncio.get_running_loop().create_task(self._prepare(record))
            if not wait:
                self._preparing.add_done_callback(self._prepared)
        if wait:
            await asyncio.shield(self._preparing)

    async def _prepare(self, record: Generation) -> None:
        """Build and warm ``record``'s parts (up to WARM_S); keep them unless the rollout
        named another target meanwhile or a switch built them first."""
        assert self._build is not None
        target = record.name
        try:
            bundle = await self._build(record)
        except (Unavailable, FailedPrecondition) as exc:  # its shards are not up yet
            log.debug("generation %s cannot be prepared yet: %s", target, exc)
            return
        try:
            await warm(bundle, WARM_S)
        except BaseException:  # cancelled (the source closes): nothing may keep it open
            await asyncio.shield(bundle.close())
            raise
        if target in self._bundles or self._target != target:  # built meanwhile / gone
            await bundle.close()
            return
        self._bundles[target] = bundle
        log.info("generation %s (%s) prepared for its switch", target, record.state)

    def _prepared(self, task: asyncio.Task[None]) -> None:
        """A background preparation's failure, reported with a last error of its own."""
        error = None if task.cancelled() else task.exception()
        self._prepare_error = "" if error is None else self._report(error, self._prepare_error)

    def _retire_others(self, keep: set[str]) -> None:
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
        while True:
            await asyncio.sleep(self.refresh_s)
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
