"""The gateway's GenerationSource (services/gateway/generations.py) over a real Redis
registry (issue #24): the alias is read from memory per request, re-read once for many
concurrent callers, a generation's parts are built once and closed only after the last
request that holds them, and a generation that cannot be built yet leaves the old one
serving until it can.

The bundles' parts here are plain objects that record whether they were closed: what is
under test is when the source builds, keeps and closes them (the real parts over real
shards: test_gateway_generations.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import pytest
import redis

from services.common.errors import InvalidArgument, Unavailable
from services.gateway import generations
from services.gateway.generation_parts import Bundle, RedisAliasReader, resolve_token
from services.gateway.generations import GenerationSource
from services.generations.registry import Alias, EncoderSpec, Generation, Registry
from services.index.keys import ADDRESSES_KEY
from services.process.redis_client import async_client
from tests.support.processes import await_until

SPEC = EncoderSpec("embed", 1, 8, "d1")


class Part:
    """One part of a bundle (encoder, router, ...): knows whether it was closed."""

    model_name = "test-encoder"
    dim = 8

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def bundle_of(name: str, part: Any) -> Bundle:
    """A bundle whose every part is ``part``."""
    return Bundle(name, part, part, part, part, part, owned=[part])


class Counting(RedisAliasReader):
    """The real reader, counting its alias reads."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.reads = 0

    async def alias(self) -> Alias | None:
        alias = await super().alias()
        self.reads += 1
        await asyncio.sleep(0.05)  # the read's answer on its way while others arrive
        return alias


class Factory:
    """Builds a bundle per generation, refusing one whose addresses are not recorded yet
    (as the gateway's GenerationParts does)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.source: GenerationSource | None = None  # the one it builds for
        self.built: list[str] = []
        self.parts: dict[str, Part] = {}

    async def __call__(self, gen: Generation) -> Bundle:
        if gen.name != "g1" and not await self.client.hexists(ADDRESSES_KEY, gen.name):
            raise Unavailable(f"generation {gen.name} has no shard addresses yet")
        self.built.append(gen.name)
        part = self.parts[gen.name] = Part(gen.name)
        return bundle_of(gen.name, part)


@pytest.fixture
def registry(redis_url: str) -> Iterator[Registry]:
    client = redis.Redis.from_url(redis_url)
    registry = Registry(client)
    registry.ensure_first(2, SPEC, "/idx/g1")
    yield registry
    client.close()


def new_generation(registry: Registry, addresses: bool = True) -> Generation:
    gen = registry.create(2, SPEC, "/idx", {"trained": True})
    if addresses:
        registry.set_addresses(gen.name, "127.0.0.1:1;127.0.0.1:2")
    return gen


async def switch_during_a_read(
    source: GenerationSource, reader: Counting, registry: Registry
) -> asyncio.Future[Any]:
    """Start the source, begin a read of epoch 1, switch to a new generation (epoch 2)
    while that read's answer is on its way; → the read in flight."""
    await source.start()
    stale = asyncio.ensure_future(source.refresh())
    await await_until(lambda: reader.reads == 2, "a read of epoch 1 on its way")
    registry.switch(new_generation(registry).name, {})
    return stale


SCENARIO_S = 60.0  # each scenario takes about a second; past this it hung


def _awaiting(coro: Any) -> list[str]:
    """Where a coroutine waits: its frame, then what it awaits, and so on down."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f"  {code.co_filename}:{frame.f_lineno} {code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


def run(scenario: Any) -> None:
    """``asyncio.run(scenario)``, bounded: a scenario still running after SCENARIO_S
    prints every task's stack (captured output: where it hung) and is cancelled, and the
    test fails saying so (one hung under CI load once, 2026-11-29; not reproduced)."""

    async def watched() -> None:
        main = asyncio.current_task()
        assert main is not None
        stacks: list[str] = []

        def hung() -> None:
            for task in asyncio.all_tasks():
                stacks.append(f"{task.get_name()}:\n" + "\n".join(_awaiting(task.get_coro())))
            print("scenario hung; its tasks:\n" + "\n".join(stacks), flush=True)
            main.cancel()

        watchdog = asyncio.get_running_loop().call_later(SCENARIO_S, hung)
        try:
            await scenario
        except asyncio.CancelledError:
            if stacks:
                raise AssertionError(
                    f"the scenario hung past {SCENARIO_S:.0f} s:\n" + "\n".join(stacks)
                ) from None
            raise
        finally:
            watchdog.cancel()

    asyncio.run(watched())


class Builds(Protocol):
    """A bundle factory that is told which source it builds for (``source``)."""

    source: GenerationSource | None

    async def __call__(self, gen: Generation) -> Bundle: ...


R = TypeVar("R", bound=RedisAliasReader)
F = TypeVar("F", bound=Builds)


@dataclass
class Scene(Generic[R, F]):
    """A source over a real Redis with its alias reader and its bundle factory."""

    reader: R
    factory: F
    source: GenerationSource


@asynccontextmanager
async def opened(
    redis_url: str,
    reader: Callable[[Any], R],
    factory: Callable[[Any], F],
    refresh_s: float = 60,
) -> AsyncIterator[Scene[R, F]]:
    """A source (not started yet) that reads the alias with ``reader`` and builds with
    ``factory``, both over one client of ``redis_url``; the source and then the client
    are closed on exit."""
    client = async_client(redis_url)
    read, build = reader(client), factory(client)
    build.source = source = GenerationSource(read, build, refresh_s=refresh_s)
    try:
        yield Scene(read, build, source)
    finally:
        await source.close()
        await client.aclose()


def test_a_search_reads_the_alias_from_memory_and_concurrent_refreshes_share_one_read(
    redis_url: str, registry: Registry
) -> None:
    async def scenario() -> None:
        async with opened(redis_url, Counting, Factory) as scene:
            source, reader = scene.source, scene.reader
            first = await source.start()
            assert (first.generation, first.epoch, reader.reads) == ("g1", 1, 1)
            for _ in range(1000):
                assert source.current() is first
            assert reader.reads == 1, "current() must not read Redis"
            answers = await asyncio.gather(*[source.refresh() for _ in range(50)])
            assert reader.reads == 2, "50 concurrent refreshes: one read"
            assert all(a is first for a in answers), "an unchanged alias keeps its Serving"

    run(scenario())


def test_a_retired_generation_is_closed_after_its_last_request(
    redis_url: str, registry: Registry
) -> None:
    async def scenario() -> None:
        async with opened(redis_url, RedisAliasReader, Factory) as scene:
            source, factory = scene.source, scene.factory
            g1 = await source.start()
            with source.lease(g1):  # a request on g1 spans two switches
                g2 = new_generation(registry)
                registry.switch(g2.name, {0: "5-0"})
                serving = await source.refresh()
                assert (serving.generation, serving.epoch) == ("g2", 2)
                assert serving.switch_in == {0: "5-0"} and serving.previous == "g1"
                assert not factory.parts["g1"].closed, "the previous generation stays open"
                g3 = new_generation(registry)
                registry.switch(g3.name, {})
                await source.refresh()
                assert sorted(source.bundles()) == ["g2", "g3"]
                assert not factory.parts["g1"].closed, "closed under a running request"
            await await_until(lambda: factory.parts["g1"].closed, "g1 closed after its lease")
            # a rollback to g2 finds its parts open: nothing is built again
            registry.switch("g2", {0: "9-0"})
            back = await source.refresh()
            assert (back.generation, back.epoch, back.switch_in) == ("g2", 4, {0: "9-0"})
            assert factory.built == ["g1", "g2", "g3"]
        assert all(p.closed for p in factory.parts.values())

    run(scenario())


def test_a_generation_that_cannot_be_built_yet_leaves_the_old_one_serving(
    redis_url: str, registry: Registry
) -> None:
    async def scenario() -> None:
        async with opened(redis_url, RedisAliasReader, Factory, refresh_s=0.05) as scene:
            source = scene.source
            await source.start()
            g2 = new_generation(registry, addresses=False)
            registry.switch(g2.name, {})
            with pytest.raises(Unavailable, match="no shard addresses"):
                await source.refresh()
            assert source.current().generation == "g1", "searches go on with g1"
            registry.set_addresses(g2.name, "127.0.0.1:1;127.0.0.1:2")
            # the background refresh builds it as soon as it can
            await await_until(lambda: source.current().generation == "g2", "g2 serves", 10)

    run(scenario())


def test_a_write_token_keeps_its_meaning_across_switches() -> None:
    from services.common.domain import TokenOrigin
    from services.gateway.generation_parts import Serving

    g2 = Serving("g2", 3, bundle_of("g2", Part("g2")), {0: "100-0", 1: "100-1", 2: "90-0"})
    own = {0: "120-0"}
    # the serving epoch: as it is
    assert resolve_token(own, TokenOrigin("g2", 3), g2) == own
    # an older epoch of another generation: the serving one's positions at its switch
    assert resolve_token({1: "5-0"}, TokenOrigin("g1", 1), g2) == g2.switch_in
    # an older epoch of the serving generation (a rollback serves its logs again): both
    assert resolve_token(own, TokenOrigin("g2", 2), g2) == {0: "120-0", 1: "100-1", 2: "90-0"}
    # no origin (a token built from positions): g1's, from before any switch
    assert resolve_token({0: "1-0"}, TokenOrigin(), g2) == g2.switch_in
    g1 = Serving("g1", 1, bundle_of("g1", Part("g1")))
    assert resolve_token({0: "1-0"}, TokenOrigin(), g1) == {0: "1-0"}, "as before generations"
    with pytest.raises(InvalidArgument, match="epoch 4 is newer"):
        resolve_token(own, TokenOrigin("g2", 4), g2)
    with pytest.raises(InvalidArgument, match="generation g2's in this store, not g5's"):
        resolve_token(own, TokenOrigin("g5", 3), g2)


def test_a_redis_that_cannot_be_reached_is_unavailable_not_internal() -> None:
    """A write that re-reads the alias while Redis is down fails as its write would:
    UNAVAILABLE (safe to retry), not the client library's own error (INTERNAL)."""
    from tests.support.processes import free_port

    async def scenario() -> None:
        client = async_client(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1.0)
        try:
            reader = RedisAliasReader(client)
            with pytest.raises(Unavailable, match="reading the generations alias"):
                await reader.alias()
            with pytest.raises(Unavailable, match="reading generation g2"):
                await reader.generation("g2")
        finally:
            await client.aclose()

    run(scenario())


def test_a_newer_token_is_not_answered_by_a_read_that_began_before_its_switch(
    redis_url: str, registry: Registry
) -> None:
    """A SESSION search with a token of epoch 2 joins an alias read already in flight, one
    that began before the switch to epoch 2: the source reads again instead of calling the
    token newer than the store."""

    async def scenario() -> None:
        async with opened(redis_url, Counting, Factory) as scene:
            stale = await switch_during_a_read(scene.source, scene.reader, registry)
            serving = await scene.source.at_least(2)
            assert (serving.generation, serving.epoch) == ("g2", 2)
            assert (await stale).epoch == 1

    run(scenario())


def test_a_strong_read_is_served_by_a_read_begun_after_it_arrived(
    redis_url: str, registry: Registry
) -> None:
    """fresh(), what a STRONG search is served by: with a read of epoch 1 in flight when
    the switch to epoch 2 happens and the cached alias still at 1, it answers g2 (joining
    the read in flight, as refresh() does, would answer g1)."""

    async def scenario() -> None:
        async with opened(redis_url, Counting, Factory) as scene:
            stale = await switch_during_a_read(scene.source, scene.reader, registry)
            assert scene.source.current().epoch == 1, "the cache has not seen the switch"
            serving = await scene.source.fresh()
            assert (serving.generation, serving.epoch) == ("g2", 2)
            assert (await stale).epoch == 1

    run(scenario())


class WarmPart(Part):
    """A part that answers encode and search, recording which generation served while
    each call ran."""

    def __init__(self, name: str, factory: WarmFactory) -> None:
        super().__init__(name)
        self.factory = factory
        self.calls: list[tuple[str, str]] = []

    def serving(self) -> str:
        assert self.factory.source is not None
        return self.factory.source.current().generation

    async def encode(self, texts: Any, kind: str, timeout: float | None = None) -> Any:
        from services.encoder.base import Embeddings

        self.calls.append(("encode", self.serving()))
        return Embeddings(np.zeros((len(texts), self.dim), np.float32), [False] * len(texts))

    async def search(self, query: Any, timeout: float | None = None) -> Any:
        self.calls.append(("search", self.serving()))
        return None


class WarmFactory:
    """Builds every generation's bundle of one :class:`WarmPart` (``parts``), in the
    order ``built`` lists, for the source it is given to (``source``)."""

    def __init__(self, client: Any) -> None:
        self.source: GenerationSource | None = None
        self.parts: dict[str, WarmPart] = {}
        self.built: list[str] = []

    async def __call__(self, gen: Generation) -> Bundle:
        self.built.append(gen.name)
        part = self.parts[gen.name] = WarmPart(gen.name, self)
        return bundle_of(gen.name, part)


def test_a_switched_to_generation_is_warmed_before_it_serves(
    redis_url: str, registry: Registry
) -> None:
    """Its first query goes through its encoder and its shards while the old generation
    still serves: no search pays for the new one's cold channels and first calls."""

    async def scenario() -> None:
        async with opened(redis_url, RedisAliasReader, WarmFactory) as scene:
            source, factory = scene.source, scene.factory
            await source.start()
            assert factory.parts["g1"].calls == [], "the generation of the start is not warmed"
            registry.switch(new_generation(registry).name, {})
            serving = await source.refresh()
            assert serving.generation == "g2"
            assert factory.parts["g2"].calls == [("encode", "g1"), ("search", "g1")]

    run(scenario())


def test_a_rollout_target_is_prepared_before_its_switch_and_swapped_in_as_built(
    redis_url: str, registry: Registry
) -> None:
    """Once the rollout's target catches up, the refresh builds and warms its parts while
    the old generation serves; the switch then only swaps them in (no second build).
    A target the rollout no longer names (aborted) is closed."""

    async def scenario() -> None:
        async with opened(redis_url, RedisAliasReader, WarmFactory) as scene:
            source, parts, built = scene.source, scene.factory.parts, scene.factory.built
            await source.start()
            target = new_generation(registry)
            registry.begin_rollout({"target": target.name, "source": "g1"})
            await source.prepare_target()
            assert built == ["g1"], "a building target is not prepared yet"
            registry.set_state(target.name, "catching_up")
            await source.prepare_target()
            assert built == ["g1", target.name]
            assert parts[target.name].calls == [("encode", "g1"), ("search", "g1")]
            assert source.current().generation == "g1"
            registry.switch(target.name, {})
            registry.end_rollout()
            assert (await source.refresh()).generation == target.name
            assert built == ["g1", target.name], "the switch used the prepared parts"

            aborted = new_generation(registry)
            registry.begin_rollout({"target": aborted.name, "source": target.name})
            registry.set_state(aborted.name, "catching_up")
            await source.prepare_target()
            assert aborted.name in source.bundles()
            registry.end_rollout()  # aborted: the alias stays
            await source.prepare_target()
            assert aborted.name not in source.bundles()
            await await_until(lambda: parts[aborted.name].closed, "the aborted target closed")
            assert not parts[target.name].closed

    run(scenario())


async def switch_during_preparation(
    source: GenerationSource, factory: Any, registry: Registry, began: Callable[[str], bool]
) -> Generation:
    """Start ``source``; begin a rollout whose target ``factory`` holds up (its ``slow``
    set), wait until ``began(target)`` says its background preparation started, then
    switch the alias to it and end the rollout; → the target."""
    await source.start()
    target = new_generation(registry)
    factory.slow.add(target.name)
    registry.begin_rollout({"target": target.name, "source": "g1"})
    registry.set_state(target.name, "catching_up")
    await await_until(lambda: began(target.name), "its preparation began")
    registry.switch(target.name, {})
    registry.end_rollout()
    return target


class SlowWarmFactory(WarmFactory):
    """As WarmFactory; the parts of the generations in ``slow`` answer their warm-up
    encode only once ``release`` is set (a new encoder's graph being opened and probed,
    or shards slow to answer their first search). Every part built is kept in ``all``."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.slow: set[str] = set()
        self.release = asyncio.Event()
        self.all: list[WarmPart] = []

    async def __call__(self, gen: Generation) -> Bundle:
        bundle = await super().__call__(gen)
        part = self.parts[gen.name]
        self.all.append(part)
        if gen.name in self.slow:
            answer = part.encode

            async def held(texts: Any, kind: str, timeout: float | None = None) -> Any:
                await self.release.wait()
                return await answer(texts, kind, timeout)

            part.encode = held  # type: ignore[method-assign]
        return bundle


def test_a_switch_is_followed_while_the_rollout_targets_warm_up_is_still_running(
    redis_url: str, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background refresh prepares a rollout's target in a task of its own: while
    the target's warm-up hangs (here for as long as WARM_S, made a minute), the alias is
    still read every tick, so a switch is served within a tick and the inline warm-up's
    0.25 s, not after the minute (it was: searches kept the old generation seconds past
    a switch under load, tests/integration/test_generations_e2e.py in CI)."""
    monkeypatch.setattr(generations, "WARM_S", 60.0)

    async def scenario() -> None:
        async with opened(redis_url, RedisAliasReader, SlowWarmFactory, 0.05) as scene:
            source, factory = scene.source, scene.factory
            target = await switch_during_preparation(
                source, factory, registry, lambda name: name in factory.built
            )
            await await_until(
                lambda: source.current().generation == target.name, "the switch served", 10
            )
            factory.release.set()  # the preparation's warm-up ends
            part = factory.parts[target.name]
            await await_until(lambda: part.calls[-1:] == [("search", target.name)], "warmed")
            # the switch took the prepared parts (built once), and they stay open
            built = [p for p in factory.all if p.name == target.name]
            assert len(built) == 1 and not built[0].closed, built

    run(scenario())


class SlowBuildFactory(Factory):
    """As Factory; building a generation in ``slow`` (a new encoder's graph loaded, its
    shards' channels opened) waits for ``release``; ``started`` lists every build begun."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.slow: set[str] = set()
        self.release = asyncio.Event()
        self.started: list[str] = []

    async def __call__(self, gen: Generation) -> Bundle:
        self.started.append(gen.name)
        if gen.name in self.slow:
            await self.release.wait()
        return await super().__call__(gen)


def test_a_switch_during_the_targets_background_build_waits_for_it_and_builds_no_second(
    redis_url: str, registry: Registry
) -> None:
    """The alias moves while the background preparation is still building the target's
    parts: the switch takes those parts once built instead of building a second set (it
    did: two encoders loaded at once on a busy CPU, the old generation served meanwhile,
    and the first set was never closed, test_generations_e2e's gateway log)."""

    async def scenario() -> None:
        async with opened(redis_url, RedisAliasReader, SlowBuildFactory, 0.05) as scene:
            source, factory = scene.source, scene.factory
            target = await switch_during_preparation(
                source, factory, registry, lambda name: name in factory.started
            )
            refreshed = asyncio.ensure_future(source.refresh())
            assert source.current().generation == "g1", "served before its parts exist"
            factory.release.set()
            assert (await refreshed).generation == target.name
            assert factory.started == ["g1", target.name], "one build of the target"
            assert source.bundles()[target.name].index is factory.parts[target.name]
            assert not factory.parts[target.name].closed

    run(scenario())


def test_a_preparation_during_a_switchs_build_of_the_target_joins_it_and_builds_no_second(
    redis_url: str, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    """The other order: the alias moves to the rollout's target before any background
    preparation began (a refresh came first), and while the switch builds the target's
    parts the background refresh sets out to prepare that same target. It joins the
    switch's build: one set of parts (it built a second set and closed it, 0.3 s of a busy
    CPU at the switch, test_generations_e2e's gateway log)."""
    caplog.set_level(logging.INFO, logger=generations.__name__)

    async def scenario() -> None:
        async with opened(redis_url, RedisAliasReader, SlowBuildFactory) as scene:
            source, factory = scene.source, scene.factory
            await source.start()
            target = new_generation(registry)
            factory.slow.add(target.name)
            registry.begin_rollout({"target": target.name, "source": "g1"})
            registry.set_state(target.name, "switching")
            registry.switch(target.name, {})  # the rollout still names it: not ended yet
            switched = asyncio.ensure_future(source.refresh())
            await await_until(lambda: target.name in factory.started, "the switch's build")
            # the background refresh read the target's record before the switch: state
            # ``switching`` (registry.switch made it ``serving``; put back for that read)
            registry.set_state(target.name, "switching")
            await source.prepare_target(wait=False)  # starts the background preparation
            factory.release.set()
            assert (await switched).generation == target.name
            prepared = f"generation {target.name} (switching) prepared for its switch"
            await await_until(  # the preparation ended, or built a second set
                lambda: prepared in caplog.text or factory.started.count(target.name) > 1,
                "the preparation's end",
            )
            assert factory.started == ["g1", target.name], "one build of the target"
            assert source.bundles()[target.name].index is factory.parts[target.name]
            assert not factory.parts[target.name].closed

    run(scenario())


def test_the_alias_is_read_every_tick_of_a_switch_not_every_refresh_interval(
    redis_url: str, registry: Registry
) -> None:
    """While the rollout's target is ``switching`` the alias is about to move: the
    background loop reads it every SWITCH_REFRESH_S, so a gateway whose interval is long
    (here a minute) serves the switch long before its next ordinary read."""

    async def scenario() -> None:
        async with opened(redis_url, RedisAliasReader, Factory, 60.0) as scene:
            source = scene.source
            await source.start()
            target = new_generation(registry)
            registry.begin_rollout({"target": target.name, "source": "g1"})
            registry.set_state(target.name, "switching")
            await source.prepare_target()  # as the loop's next read would find it
            registry.switch(target.name, {})
            registry.end_rollout()
            await await_until(
                lambda: source.current().generation == target.name,
                "the switch served within the switch's ticks",
                10,
            )

    run(scenario())


class LosesACancel(RedisAliasReader):
    """The real reader, except that a cancel arriving while it reads the rollout is lost
    once (redis-py's sends on Python 3.11 lose one when it lands as the send completes)."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.reading = asyncio.Event()
        self.lost = False

    async def rollout_target(self) -> str | None:
        if not self.lost:
            self.reading.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.lost = True  # swallowed, as the library does
        return await super().rollout_target()


def test_close_ends_the_background_refresh_even_when_its_cancel_is_lost(
    redis_url: str, registry: Registry
) -> None:
    """The loop is stopped by a flag as well as by its cancel, and close() does not
    swallow a cancellation of its own caller (it did: a lost cancel hung the gateway's
    shutdown, and the test's own bound on it was swallowed with it)."""

    async def scenario() -> None:
        async with opened(redis_url, LosesACancel, Factory, 0.05) as scene:
            await scene.source.start()
            await scene.reader.reading.wait()  # the loop is inside its rollout read
            async with asyncio.timeout(10):
                await scene.source.close()
            assert scene.reader.lost, "the scenario lost no cancel"

    run(scenario())


def test_a_rollout_target_not_recorded_yet_is_left_for_a_later_refresh(
    redis_url: str, registry: Registry
) -> None:
    """`index rollout --encoder` takes the rollout lock before it publishes its encoder and
    records its target only after the publish (seconds to minutes): meanwhile the refresh
    finds a target without a record and leaves it (it raised NotFound: a warning and a
    failed refresh on every tick of the publish); once recorded and catching up it is
    prepared as any target."""

    async def scenario() -> None:
        async with opened(redis_url, RedisAliasReader, WarmFactory) as scene:
            source, factory = scene.source, scene.factory
            try:
                await source.start()
                registry.begin_rollout({"target": "g2", "source": "g1", "phase": "publish"})
                await source.prepare_target()
                assert factory.built == ["g1"]
                target = new_generation(registry)
                assert target.name == "g2"
                registry.set_state(target.name, "catching_up")
                await source.prepare_target()
                assert factory.built == ["g1", "g2"]
            finally:
                registry.end_rollout()

    run(scenario())


def test_the_serving_generations_retrieval_setting_comes_and_goes_with_it(
    redis_url: str, registry: Registry
) -> None:
    """Issue #35: a switch to a generation whose record carries a retrieval setting
    serves it; the rollback serves the old record again, with none (the gateway's flags)."""
    import dataclasses

    from services.common.fusion import Fusion, Method
    from services.common.retrieval_setting import RetrievalSetting

    setting = RetrievalSetting(fusion=Fusion(Method.RRF, rrf_k=7), candidates=30)

    async def scenario() -> None:
        async with opened(redis_url, RedisAliasReader, Factory) as scene:
            source = scene.source
            assert (await source.start()).setting is None  # g1: a record without one
            g2 = new_generation(registry)
            registry.put(dataclasses.replace(g2, retrieval=setting))
            registry.switch(g2.name, {})
            served = await source.refresh()
            assert (served.generation, served.setting) == ("g2", setting)
            registry.switch("g1", {})  # a rollback
            back = await source.refresh()
            assert (back.generation, back.setting) == ("g1", None)

    run(scenario())


class FailingTarget(Factory):
    """Builds g1; every other generation's build fails with the same error."""

    attempts = 0

    async def __call__(self, gen: Generation) -> Bundle:
        if gen.name == "g1":
            return await super().__call__(gen)
        self.attempts += 1
        raise RuntimeError(f"generation {gen.name}: no encoder")


def test_a_preparation_that_keeps_failing_is_logged_once(
    redis_url: str, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    """The background refresh prepares a rollout's target in a task of its own, and the
    refreshes between succeed: the same failure, tick after tick, is one warning (it was
    one per tick), and each is still counted as a failed refresh."""

    async def scenario() -> None:
        async with opened(redis_url, RedisAliasReader, FailingTarget, 0.02) as scene:
            source, factory = scene.source, scene.factory
            await source.start()
            target = new_generation(registry)
            registry.begin_rollout({"target": target.name, "source": "g1"})
            registry.set_state(target.name, "catching_up")
            await await_until(lambda: factory.attempts >= 5, "five failed preparations")

    with caplog.at_level(logging.WARNING, logger=generations.__name__):
        run(scenario())
    warned = [r for r in caplog.records if "no encoder" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
