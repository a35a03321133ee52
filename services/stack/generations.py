"""The local stack's generations supervisor (issue #24, docs/generations.md).

``gtr-retrieval up`` runs the shards of every index generation whose shards should run:
a record in a running state (:data:`services.generations.registry.RUNNING`: building,
catching up, switching, serving, previous) whose index is trained (``params["trained"]``,
set by the rollout once the generation's ``index_dir`` holds its trained index; g1's is
the stack's own, always trained). Every :data:`POLL_S` it reads the registry and

- starts the shards of such a generation it does not run yet, with g1's replica count and
  settings, ``--generation G --shards <its count> --index-dir <its index_dir>``, snapshot
  folders of its own under the run dir (:meth:`StackConfig.snapshot_dir`), and publishes
  their addresses in ``{gtr}:addrs`` (the gateway routes a generation's searches there, the
  rollout waits for them before the switch) and in ``stack.json`` (``generations``);
- stops the shards of a generation that no longer runs (retired, failed, record gone) and
  removes its addresses; a retired one's snapshot folders, and its index when it lies under
  the stack's index root, are deleted;
- keeps ``{gtr}:addrs`` equal to what runs: addresses of an earlier run of the stack (other
  ports) are replaced at start, before the gateway reads them.

A shard that exits is restarted by the :class:`Supervisor` like every child (same argv,
port and data). Only the serving generation's shards are essential: one of them failing
past the restart policy stops the stack, as before generations; another generation's
shard failing that often is given up on, its generation's shards stopped and its addresses
removed, and started again after ``restart.window_s`` on the same ports (a gateway that
routes to them finds them there; a broken rollout target must not take the serving stack
down). A generation whose shards do not start is retried alike (on fresh ports).

At ``up`` (:meth:`GenerationShards.start_all`) the serving generation's shards and g1's
(the gateway's ``--shards``) start before the gateway, and every other one that should run
right after, in the background: a stack stopped during a rollout comes back with the
target's shards too (on new ports, published before the rollout can use them), and the
rollout resumes against them.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.errors import FailedPrecondition
from services.generations import placement
from services.generations.registry import Alias, Generation, Registry, shards_run
from services.generations.state import RolloutState
from services.index.keys import (
    ADDRESSES_KEY,
    CPU_BUDGET_KEY,
    CPU_PLACED_KEY,
    FIRST_GENERATION,
    HOLD_LIFTED_KEY,
)
from services.process import cpus as cpu_sets
from services.process import priority
from services.process.hold import HOLD_FILE, HoldList, hold_enabled
from services.process.private import is_private, make_private
from services.stack import components
from services.stack.children import Child, ChildFailed, Spawn, State, Supervisor
from services.stack.components import ShardGroup
from services.stack.config import StackConfig

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the registry is read


def _await_sessions(children: Iterable[Child], timeout_s: float = 1.0) -> None:
    """Until each of ``children`` (just launched) leads its own session, its first act
    (:func:`services.stack.forking.run_child`), for up to ``timeout_s``: weighing it
    before would weigh its launcher's session (:func:`placement.weigh` skips it)."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        while (
            child.pid is not None
            and child.alive()
            and not priority.leads_session(child.pid)
            and time.monotonic() < deadline
        ):
            time.sleep(0.005)


def spec(replicas: Iterable[Iterable[str]]) -> str:
    """Shard addresses in the gateway's ``--shards`` syntax: ``a,b;c,d``."""
    return ";".join(",".join(r) for r in replicas)


@dataclass
class RunningGeneration:
    record: Generation
    children: list[list[Child]]  # per shard, its replicas

    @property
    def addresses(self) -> list[list[str]]:
        return [[c.address for c in reps] for reps in self.children]

    def all(self) -> list[Child]:
        return [c for reps in self.children for c in reps]


class GenerationShards:
    """Runs the shards of the registry's generations (see the module docstring)."""

    def __init__(
        self,
        cfg: StackConfig,
        supervisor: Supervisor,
        redis_url: str,
        *,
        tls: ClientTLS | None = None,
        report: Callable[[str], None] = print,
        on_change: Callable[[], None] | None = None,
        poll_s: float = POLL_S,
        spawn: Spawn | None = None,
    ) -> None:
        self.cfg = cfg
        self.spawn = spawn  # how shard processes start (the fork server's), None: exec
        self.supervisor = supervisor
        self.redis_url = redis_url  # the whole URL (password, certificates)
        self.tls = tls  # how the readiness probe reaches a shard
        self.report = report
        self.on_change = on_change  # stack.json, Prometheus's targets
        self.poll_s = poll_s
        self.running: dict[str, RunningGeneration] = {}
        # a generation whose shards did not start or kept failing -> when to try again
        self.retry_at: dict[str, float] = {}
        # each generation's ports (per shard, its replicas'), kept for a start again in
        # this run: a gateway that routes to them finds them where they were
        self._ports: dict[str, list[list[int]]] = {}
        self._cleaned: set[str] = set()  # retired generations whose files are deleted
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._last_error = ""
        self.passes = 0  # registry reads done (a test awaits a pass instead of sleeping)
        # every CPU this process may use: serving's always (a budget confines the rollout)
        self.machine = cpu_sets.available()
        self._placed: tuple[frozenset[int] | None, frozenset[int]] | None = None
        self._yielded: dict[int, str] = {}  # pid → generation: processes at the least weight
        # a generation's shards launched and not ready yet (a target's start replays its
        # logs for seconds: it yields and is held from its launch, not from its readiness)
        self._starting: dict[str, list[Child]] = {}
        self._yield = priority.yield_enabled()
        # the rollout's processes the gateway pauses while searches run (--hold-file)
        self._hold = HoldList(cfg.run_dir / HOLD_FILE) if hold_enabled() else None

    # --- lifecycle -----------------------------------------------------------------------

    def start_all(self) -> None:
        """At ``up``, before the gateway: start the shards the gateway needs, the serving
        generation's and g1's (its ``--shards``), and publish the addresses (ChildFailed
        when the serving one's do not start). The others (a rollout's target, a previous
        generation) follow in the background once :meth:`watch` runs, so a target that
        replays a long log does not hold the gateway back."""
        if self._hold is not None:
            self._hold.start()
        self.sync(raise_serving=True, only=lambda gen, serving: gen in (serving, FIRST_GENERATION))

    def watch(self) -> None:
        """From now on, follow the registry in a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="generations", daemon=True)
            self._thread.start()

    def halt(self) -> None:
        """No generation starts from now on (the stack is stopping)."""
        self._stop.set()

    def close(self) -> None:
        """Stop following the registry (the children are the supervisor's to stop)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._client is not None:
            self._client.close()
            self._client = None

    def _loop(self) -> None:
        import redis

        while not self._stop.wait(self.poll_s):
            try:
                self.sync()
                self._last_error = ""
            except (redis.RedisError, OSError) as exc:  # Redis restarting: next poll
                log.debug("generations: registry not readable: %s", exc)
                self._drop_client()
            except ChildFailed as exc:  # the stack is stopping
                log.debug("generations: %s", exc)
            except Exception as exc:
                if str(exc) != self._last_error:
                    log.exception("generations: supervising failed")
                    self.report(f"generations: {exc}")
                self._last_error = str(exc)

    # --- one pass ------------------------------------------------------------------------

    def _redis(self) -> Any:
        if self._client is None:
            self._client = components._redis(self.redis_url)
        return self._client

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def read(self) -> tuple[dict[str, Generation], Alias | None, dict[str, str]]:
        """The registry: records, alias (None before g1), published addresses."""
        client = self._redis()
        registry = Registry(client)
        gens = {g.name: g for g in registry.all()}
        try:
            alias: Alias | None = registry.alias()
        except FailedPrecondition:
            alias = None
        raw = client.hgetall(ADDRESSES_KEY)
        return gens, alias, {k.decode(): v.decode() for k, v in raw.items()}

    def sync(
        self, raise_serving: bool = False, only: Callable[[str, str], bool] | None = None
    ) -> None:
        """One pass: stop what should not run, start what should (``only``: of those, the
        generations it accepts, given the serving one's name), publish the addresses."""
        gens, alias, addrs = self.read()
        serving = alias.serving if alias is not None else FIRST_GENERATION
        want = {name: g for name, g in gens.items() if shards_run(g)}
        changed = False
        for name in [n for n in self.running if n not in want]:
            self._stop_generation(name, gens.get(name))
            changed = True
        for name in [n for n in self.retry_at if n not in want]:
            del self.retry_at[name]
        for gen in gens.values():  # retired while no stack watched
            if gen.state == "retired" and gen.name not in self._cleaned:
                self._delete_files(gen)
        for name, running in list(self.running.items()):
            if any(c.state is State.STOPPED for c in running.all()):  # given up on
                self._give_up(name, "a shard kept failing")
                changed = True
        order = sorted(want.values(), key=lambda g: (g.name != serving, g.number))
        for gen in order:
            if self._stop.is_set():
                break
            if only is not None and not only(gen.name, serving):
                continue
            if gen.name in self.running or self.retry_at.get(gen.name, 0.0) > time.monotonic():
                continue
            essential = gen.name == serving
            try:
                self._start_generation(gen, essential)
            except ChildFailed:
                if raise_serving and essential:
                    raise
                if self.supervisor.failure is not None or self._stop.is_set():
                    raise
            changed = True
        for name, running in self.running.items():
            for child in running.all():
                child.essential = name == serving
        self._publish(addrs)
        if changed:
            self._changed()
        self.place_cpus()
        self.passes += 1

    def _budget(self) -> frozenset[int] | None:
        """The running rollout's CPU budget on this machine (None: none, or one that
        leaves serving nothing here)."""
        raw = self._redis().get(CPU_BUDGET_KEY)
        return placement.active_budget(raw, self.machine)

    def _budgeted_target(self) -> str:
        """The generation whose processes a CPU budget holds: the rollout's target until
        its switch phase, when they go to every CPU before the alias names it
        (:mod:`services.generations.placement`); "" none."""
        return placement.budgeted_target(self._rollout())

    def _rollout(self) -> RolloutState | None:
        return Registry(self._redis()).running()

    def place_cpus(self) -> None:
        """A rollout's CPU budget (:mod:`services.generations.placement`): its processes on its
        CPUs, serving on every CPU; without one, everything on every CPU. Applied on every
        pass while a budget holds (new threads, a stub loaded), else when the children
        changed."""
        budget = self._budget()
        running = self._rollout() if budget else None
        target = placement.budgeted_target(running)
        ours = self.running.get(target)
        rollout_children = {id(c) for c in ours.all()} if ours is not None else set()
        rollout_children |= {id(c) for c in self._starting.get(target, [])}
        processes: list[placement.Process] = []
        stubs: set[int] = set()
        for child in list(self.supervisor.children):
            proc = child.process
            if proc is None or proc.poll() is not None:
                continue
            processes.append(placement.Process(proc.pid, id(child) in rollout_children))
            if child.name == "triton":  # its backend stubs
                for stub in cpu_sets.children_of(proc.pid):
                    age = placement.stub_budget_age(stub)
                    if budget is None and age is not None and age < placement.PUBLISH_GRACE_S:
                        continue  # published for a rollout that records its budget next
                    # the new version's stub, until the target is handed over
                    processes.append(placement.Process(stub, age is not None and bool(target)))
                    stubs.add(stub)
        self._weigh(processes, stubs, target)
        if self._hold is not None:  # none while the catch-up does not gain on the writes
            lifted = bool(target) and bool(self._redis().exists(HOLD_LIFTED_KEY))
            held = placement.held(processes, running if target else None)
            self._hold.update([] if lifted else held)
        state = (budget, frozenset(p.pid for p in processes))
        if budget is None and state == self._placed:
            return
        changed = placement.apply(placement.placement(processes, self.machine, budget))
        if changed or state != self._placed:
            where = cpu_sets.format_cpus(budget) if budget else "none"
            log.info("CPU budget %s (%s): %d thread(s) moved", where, target or "-", changed)
        self._placed = state
        if budget is not None:  # what the builder's switch waits for
            holding = target or next(iter(self._yielded.values()), "")
            self._redis().set(CPU_PLACED_KEY, holding, ex=placement.PLACED_TTL_S)

    def _weigh(self, processes: list[placement.Process], stubs: set[int], target: str) -> None:
        """The rollout's shard processes at the least weight until the hand-over
        (:func:`placement.weigh`; a Triton stub shares Triton's session: not weighed)."""
        wanted = (
            {p.pid: target for p in processes if p.rollout and p.pid not in stubs}
            if self._yield
            else {}
        )
        if wanted or self._yielded:
            self._yielded = placement.weigh(self._yielded, wanted)

    def _start_generation(self, gen: Generation, essential: bool) -> None:
        cfg = self.cfg
        group = ShardGroup(
            gen.name,
            gen.num_shards,
            Path(gen.index_dir) if gen.name != FIRST_GENERATION else None,
        )
        if group.index_dir is not None and group.index_dir.resolve().is_relative_to(
            cfg.run_dir.resolve()
        ):
            # trained by `index rollout` under its user's umask: the owner's only, as all
            # of the run directory (services.process.private.make_private), and so is the
            # folder it made for it (<run-dir>/generations: its listing names them)
            make_private(group.index_dir)
            for parent in group.index_dir.resolve().parents:
                if parent == cfg.run_dir.resolve():
                    break
                if not is_private(parent):
                    parent.chmod(0o700)
        children: list[list[Child]] = []
        budget = self._budget() if gen.name == self._budgeted_target() else None
        known = self._ports.get(gen.name, [])
        # each replica's --peers: the others of its shard
        ports = (
            known
            if len(known) == gen.num_shards
            else [components.shard_ports(cfg) for _ in range(gen.num_shards)]
        )
        self._ports[gen.name] = ports
        try:
            for shard in range(gen.num_shards):
                replicas: list[Child] = []
                children.append(replicas)
                for replica in range(cfg.replicas):
                    child = components.shard_child(cfg, shard, replica, ports[shard], group)
                    child.essential = essential
                    child.cpus = budget  # a rollout target starts on its CPU budget
                    child.spawn = self.spawn
                    ready = _probe(child, self.tls)
                    self.supervisor.launch(child, ready, cfg.startup_timeout_s)
                    replicas.append(child)
            if budget is not None:
                starting = [c for reps in children for c in reps]
                _await_sessions(starting)  # weighed only once it leads its own session
                self._starting[gen.name] = starting
                self.place_cpus()
            for child in (c for reps in children for c in reps):
                self.supervisor.await_ready(child)
        except ChildFailed as exc:
            started = [c for reps in children for c in reps]
            self.supervisor.remove(started, grace=2.0)
            self._ports.pop(gen.name, None)  # perhaps taken meanwhile: fresh ones next time
            if not self._stop.is_set() and self.supervisor.failure is None:
                self.retry_at[gen.name] = time.monotonic() + self.cfg.restart.window_s
                self.report(
                    f"generation {gen.name}: its shards did not start (again in "
                    f"{self.cfg.restart.window_s:.0f} s): {exc}"
                )
            raise
        finally:
            self._starting.pop(gen.name, None)
        running = RunningGeneration(gen, children)
        self.running[gen.name] = running
        self.retry_at.pop(gen.name, None)
        self.report(
            f"generation {gen.name} ({gen.state}): {gen.num_shards} shard(s) x "
            f"{cfg.replicas} replica(s) at {spec(running.addresses)}"
        )

    def _stop_generation(self, name: str, record: Generation | None) -> None:
        running = self.running.pop(name)
        killed = self.supervisor.remove(running.all())
        state = record.state if record is not None else "gone"
        self.report(
            f"generation {name} ({state}): its shards stopped"
            + (f" (killed: {', '.join(killed)})" if killed else "")
        )
        if record is None or record.state == "retired":
            self._delete_files(record or running.record)

    def _give_up(self, name: str, why: str) -> None:
        running = self.running.pop(name)
        self.supervisor.remove(running.all(), grace=2.0)
        self.retry_at[name] = time.monotonic() + self.cfg.restart.window_s
        self.report(
            f"generation {name}: {why}; its shards stopped, started again in "
            f"{self.cfg.restart.window_s:.0f} s"
        )

    def _delete_files(self, record: Generation) -> None:
        """A retired generation's snapshots, and its index when the stack's own root
        holds it (g1's index is the stack's and stays); for g1, every g1 replica's folder.
        Also for one retired while no stack watched (``up`` killed before it saw the
        retire): every retired record is checked once per run."""
        cfg = self.cfg
        self._cleaned.add(record.name)
        if record.name == FIRST_GENERATION:
            folders = list((cfg.run_dir / "snapshots").glob("shard-*-replica-*"))
        else:
            folders = [cfg.generation_snapshots(record.name)]
            index_dir = Path(record.index_dir).resolve()
            if record.index_dir and index_dir.is_relative_to(cfg.index_root.resolve()):
                folders.append(index_dir)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)

    def _publish(self, published: dict[str, str]) -> None:
        """``{gtr}:addrs`` := what runs (only the fields that differ are written)."""
        want = {name: spec(r.addresses) for name, r in self.running.items()}
        client = self._redis()
        stale = [name for name in published if name not in want]
        if stale:
            client.hdel(ADDRESSES_KEY, *stale)
        fresh = {name: s for name, s in want.items() if published.get(name) != s}
        if fresh:
            client.hset(ADDRESSES_KEY, mapping=fresh)

    def addresses(self) -> dict[str, list[list[str]]]:
        """Each running generation's shard addresses (read from other threads: a copy)."""
        running = list(self.running.items())  # one C-level copy, whatever the poller does
        return {name: r.addresses for name, r in sorted(running, key=lambda item: item[0])}

    def gateway_shards(self) -> list[list[str]]:
        """The gateway's ``--shards``: g1's shards while they run (the gateway's g1 falls
        back to them, and it checks the store's base shard count against their number);
        none once g1 is retired: the gateway then takes the base shard count from the
        store's key layout and the other generations' addresses from ``{gtr}:addrs``, and
        never routes a retired g1 (it used to be given another generation's addresses, or
        addresses where nothing listens, in g1's place)."""
        if FIRST_GENERATION in self.running:
            return self.running[FIRST_GENERATION].addresses
        return []

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


def _probe(child: Child, tls: ClientTLS | None) -> Callable[[], bool]:
    return lambda: components.grpc_ready(child, tls)
