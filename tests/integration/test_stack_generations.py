"""``gtr-retrieval up`` runs the shards of every index generation (issue #24).

One real stack for the module, started by the launcher ``up`` uses (:class:`Stack`: a real
redis-server, real shard processes and a real gateway under the supervisor; the in-process
encoder instead of Triton, whose versions are D's tests), on a run directory whose index
was trained on random vectors. The tests then do what a rollout does to the registry:
create a generation, train its index, mark it trained, retire it; and check that the stack
starts its shards, publishes their addresses in ``{gtr}:addrs`` and ``stack.json``, serves
the generation's own log from them, restarts one killed with ``kill -9``, and stops them
and deletes their files once it is retired; that a rollout's CPU budget puts its target's
shards on the budget's CPUs and the rest of the stack on the others; and that a rollout's
target comes back when ``up`` itself is restarted. Last, Triton as ``up`` runs it: a new
encoder version published while it serves is loaded, and kept and served again after ``up``
restarts.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import stat
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis

from retrieval.v1 import search_pb2, search_pb2_grpc
from services.generations.registry import EncoderSpec, Generation, Registry
from services.index.client.addresses import parse_shard_addresses
from services.index.client.router import ShardRouter
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.query import Consistency, IndexQuery
from services.index.core.train import TrainOptions, train_index
from services.index.keys import (
    ADDRESSES_KEY,
    CPU_BUDGET_KEY,
    CPU_PLACED_KEY,
    HOLD_LIFTED_KEY,
    ROLLOUT_KEY,
    GenerationKeys,
    Layout,
)
from services.process import hold
from services.process.cpus import (
    children_of,
    format_cpus,
    parent_pid,
    start_ticks,
    stat_fields,
)
from services.process.priority import BACKGROUND_NICE, YIELD_NICE, autogroup_enabled, group_nice
from services.process.private import PRIVATE_UMASK
from services.stack import first_run, triton_component
from services.stack.children import Child, RestartPolicy, State, Supervisor, grpc_healthy
from services.stack.config import StackConfig
from services.stack.endpoints import read_endpoints
from services.stack.generations import spec
from services.stack.launcher import Stack
from tests.encoder_fixtures import encoder_base, ensure_onnx
from tests.support.encoders import ensure_second_encoder
from tests.support.private_files import not_private
from tests.support.processes import redis_binary, wait_until

DIM = 384
FAST = RestartPolicy(backoff_s=0.05, backoff_max_s=0.2, max_restarts=2, window_s=60, poll_s=0.05)
SMALL = TrainOptions(nlist=8, pq_m=8, pq_bits=4)


def unit_vectors(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return np.asarray(v / np.linalg.norm(v, axis=1, keepdims=True))


@dataclass
class Running:
    """The module's stack (a test that restarts ``up`` puts the new one here)."""

    stack: Stack
    cfg: StackConfig
    _client: redis.Redis | None = None
    _client_url: str = ""

    @property
    def url(self) -> str:
        return self.stack.endpoints.redis_url_with_secrets()

    def registry(self) -> Registry:
        if self._client is None or self._client_url != self.url:
            self._client, self._client_url = redis.Redis.from_url(self.url), self.url
        return Registry(self._client)

    def addresses(self) -> dict[str, str]:
        """``{gtr}:addrs``: generation -> its shard addresses."""
        raw = self.registry().redis.hgetall(ADDRESSES_KEY)
        return {k.decode(): v.decode() for k, v in raw.items()}

    def polls(self, n: int = 2) -> None:
        """Wait until the generations supervisor has read the registry ``n`` more times."""
        gens = self.stack.generations
        assert gens is not None
        start = gens.passes
        wait_until(lambda: gens.passes >= start + n, f"{n} registry reads", 30)


def start_stack(cfg: StackConfig) -> Stack:
    stack = Stack(cfg)
    stack.supervisor.watch()  # what `up` does: children supervised from the start,
    stack.start()
    assert stack.generations is not None
    stack.generations.watch()  # and the registry followed once started
    return stack


def stop_stack(stack: Stack) -> None:
    if stack.generations is not None:
        stack.generations.halt()
    stack.supervisor.stop_all()
    if stack.generations is not None:
        stack.generations.close()


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    if redis_binary() is None:
        pytest.fail("redis-server is not installed (scripts/bootstrap.sh installs it)")
    cfg = StackConfig(
        run_dir=tmp_path_factory.mktemp("generations") / "run",
        shards=2,
        replicas=1,
        encoder="inprocess",
        rerank=False,
        prometheus=False,
        gateway_port=0,
        http_port=0,
        progress=False,
        startup_timeout_s=240,
        restart=FAST,
    )
    train_index(unit_vectors(1000, 0), cfg.index_dir, SMALL)  # no first-run encode
    holder = Running(start_stack(cfg), cfg)
    try:
        yield holder
    finally:
        stop_stack(holder.stack)
        if holder._client is not None:
            holder._client.close()


def new_generation(running: Running, shards: int, *, trained: bool) -> Generation:
    """What a rollout does up to its training: a record, and (``trained``) its index
    under the stack's index root and ``params["trained"]``."""
    registry = running.registry()
    index_root = read_endpoints(running.cfg.run_dir)
    assert index_root is not None and index_root.index_root
    gen = registry.create(shards, EncoderSpec("embed", 2, DIM), "", {})
    index_dir = Path(index_root.index_root) / gen.name
    gen = registry.put(replace(gen, index_dir=str(index_dir)))
    if trained:
        train_index(unit_vectors(1000, gen.number), index_dir, SMALL)
        gen = registry.put(replace(gen, params={"trained": True}))
    return gen


def listed(cfg: StackConfig) -> dict[str, list[list[str]]]:
    """The generations ``stack.json`` lists with their shards."""
    endpoints = read_endpoints(cfg.run_dir)
    return endpoints.generations if endpoints is not None else {}


async def _search_ids(spec_: str, queries: np.ndarray) -> list[str]:
    """The best hit of each query on the shards of ``spec_`` (STRONG: all applied)."""
    router = ShardRouter(parse_shard_addresses(spec_))
    try:
        # k ≥ all documents: the SQ8 refine ranks every one exactly
        query = IndexQuery(queries, 50, consistency=Consistency.STRONG)
        result = await router.search(query, timeout=30)
    finally:
        await router.close()
    return [hits[0].id if hits else "" for hits in result.hits]


@pytest.mark.slow  # the module's stack: two shards and a gateway, ~30 s
def test_up_records_g1_and_publishes_its_shards(running: Running) -> None:
    registry = running.registry()
    g1 = registry.get("g1")
    assert (g1.state, g1.num_shards) == ("serving", 2)
    assert g1.index_dir == str(running.cfg.index_dir.resolve())
    assert g1.encoder.dim == DIM
    assert registry.alias().serving == "g1"

    endpoints = read_endpoints(running.cfg.run_dir)
    assert endpoints is not None
    assert running.addresses()["g1"] == spec(endpoints.shards)
    assert endpoints.generations["g1"] == endpoints.shards
    assert all(grpc_healthy(a) for reps in endpoints.shards for a in reps)
    # what `index rollout --run-dir` reads: Redis (whole URL), an index root
    assert endpoints.redis_url_with_secrets() == running.stack._redis_url
    assert endpoints.index_root == str(running.cfg.index_root.resolve())


@pytest.mark.slow
def test_a_trained_generation_gets_shards_that_serve_its_log_until_it_is_retired(
    running: Running,
) -> None:
    cfg = running.cfg
    gen = new_generation(running, 3, trained=False)
    running.polls()
    assert gen.name not in running.addresses()  # building, not trained: no shards yet

    gen = new_generation(running, 3, trained=True)
    wait_until(lambda: gen.name in running.addresses(), f"{gen.name}'s addresses published", 120)
    shards = parse_shard_addresses(running.addresses()[gen.name])
    assert len(shards) == 3 and all(grpc_healthy(a) for reps in shards for a in reps)
    wait_until(lambda: gen.name in listed(cfg), "stack.json lists it", 30)
    # trained here under this process's umask (022), made the owner's only by `up` as it
    # starts the generation's shards (issue #33 point 3)
    index_dir = Path(gen.index_dir)
    for path in (index_dir.parent, index_dir, *index_dir.rglob("*")):  # <run-dir>/generations
        want = 0o700 if path.is_dir() else 0o600
        assert stat.S_IMODE(path.stat().st_mode) == want, (path, oct(path.stat().st_mode))

    # its shards read its own logs (another layout: 3 shards over the base's 2)
    registry = running.registry()
    keys = GenerationKeys(gen.name, Layout(3, registry.base_shards()))
    registry.set_gates(keys.layout, gen.name)
    docs = unit_vectors(30, 7)

    async def write() -> None:
        writer = ChangeLogWriter.connect(running.url, 3, dim=DIM, keys=keys)
        try:
            await writer.upsert([DocRecord(f"n{i}", docs[i]) for i in range(len(docs))])
        finally:
            await writer.close()

    asyncio.run(write())
    spec_ = running.addresses()[gen.name]
    assert asyncio.run(_search_ids(spec_, docs[:5])) == [f"n{i}" for i in range(5)]
    assert asyncio.run(_search_ids(running.addresses()["g1"], docs[:5])) != [
        f"n{i}" for i in range(5)
    ]  # g1's shards never saw them

    # kill -9 of one of its replicas: restarted on the same port
    assert running.stack.generations is not None
    victim = running.stack.generations.running[gen.name].children[1][0]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(lambda: victim.restarts == 1 and victim.state is State.RUNNING, "restarted", 120)
    assert running.addresses()[gen.name] == spec_
    assert asyncio.run(_search_ids(spec_, docs[5:8])) == ["n5", "n6", "n7"]

    # retired: its shards stop, its addresses and files go; g1 serves on
    children = running.stack.generations.running[gen.name].all()
    registry.set_state(gen.name, "retired")
    wait_until(lambda: gen.name not in running.addresses(), "addresses removed", 60)
    wait_until(lambda: not any(c.alive() for c in children), "its shards stopped", 30)
    assert not cfg.generation_snapshots(gen.name).exists()
    assert not Path(gen.index_dir).exists()
    assert all(c not in running.stack.supervisor.children for c in children)
    assert "g1" in running.addresses()


@pytest.mark.slow
def test_a_generation_whose_shards_do_not_start_leaves_the_stack_serving(
    running: Running,
) -> None:
    registry = running.registry()
    missing = running.cfg.index_root / "never-trained"
    gen = registry.create(2, EncoderSpec("embed", 2, DIM), str(missing), {"trained": True})
    gens = running.stack.generations
    assert gens is not None
    wait_until(lambda: gen.name in gens.retry_at, "its start failed, to be tried again", 120)
    assert gen.name not in gens.running and gen.name not in running.addresses()
    assert running.stack.supervisor.failure is None  # not essential: the stack serves on
    assert all(c.alive() for c in running.stack.supervisor.children)
    assert not any(c.name.startswith(f"{gen.name}-") for c in running.stack.supervisor.children)
    assert (running.cfg.logs / f"{gen.name}-shard-0-replica-0.log").stat().st_size > 0

    registry.set_state(gen.name, "failed")  # what `index rollout --abort` does
    running.polls()
    assert gen.name not in gens.retry_at


def _thread_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets the threads of ``pid`` may run on, read from ``/proc`` (one per
    distinct set; empty when the process is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return set()
    found: set[frozenset[int]] = set()
    for tid in tids:
        try:
            found.add(frozenset(os.sched_getaffinity(int(tid))))
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _weights(children: list[Child]) -> set[int | None]:
    """The autogroup nice of each of ``children``' sessions."""
    return {group_nice(c.pid) if c.pid is not None else None for c in children}


def _state(pid: int) -> bytes:
    fields = stat_fields(pid)
    return fields[0] if fields else b""


def _metric(child: Child, name: str) -> float:
    """``name``'s value on ``child``'s metrics port (0 when it has none yet)."""
    with urllib.request.urlopen(f"http://{child.metrics}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _search(gateway: Child) -> None:
    """One search through the stack's gateway, as a client sends it."""
    port = gateway.argv[gateway.argv.index("--port") + 1]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = search_pb2_grpc.SearchServiceStub(channel)
        stub.Search(search_pb2.SearchRequest(query="a rollout pauses", k=3), timeout=60)


def _all_on(children: list[Child], cpus: frozenset[int]) -> bool:
    """Whether every thread of every one of ``children`` may run on ``cpus`` and no other."""
    return all(c.pid is not None and _thread_cpus(c.pid) == {cpus} for c in children)


@pytest.mark.slow  # a generation's shards started and retired on the module's stack: ~20 s
def test_a_cpu_budget_puts_the_rollout_target_on_its_cpus_and_leaves_serving_every_cpu(
    running: Running,
) -> None:
    every = frozenset(os.sched_getaffinity(0))
    if len(every) < 2:
        pytest.skip(f"a CPU budget leaves serving one CPU at least: this test may use {len(every)}")
    budget = frozenset({max(every)})  # what `index rollout --cpus N` records
    gens = running.stack.generations
    assert gens is not None
    registry = running.registry()
    assert registry.running() is None
    target = new_generation(running, 2, trained=True)
    wait_until(lambda: target.name in running.addresses(), "the target's shards", 120)

    ours = gens.running[target.name].all()
    # forked by the stack's fork server (services/stack/forking.py), as up starts shards
    assert gens.spawn is not None  # the stack runs in this process: not its children
    assert all(c.pid is not None and parent_pid(c.pid) != os.getpid() for c in ours)
    mine = {id(c) for c in ours}
    theirs = [c for c in list(running.stack.supervisor.children) if id(c) not in mine]
    names = {c.name for c in theirs}
    assert {"redis", "gateway"} <= names
    assert {c.name for c in gens.running["g1"].all()} <= names
    assert _all_on(ours + theirs, every)  # no budget yet: every CPU for everyone

    client = registry.redis
    try:
        registry.begin_rollout({"target": target.name, "source": "g1"})
        client.set(CPU_BUDGET_KEY, format_cpus(budget), ex=120)  # the CLI's TTL is 30 s
        wait_until(
            lambda: _all_on(ours, budget) and _all_on(theirs, every),
            f"{target.name}'s shards on CPU {format_cpus(budget)}, the rest of the stack on "
            f"{format_cpus(every)}",
            30,
        )
        wait_until(
            lambda: client.get(CPU_PLACED_KEY) == target.name.encode(),
            "the stack's record that the budget holds the target",
            10,
        )
        if autogroup_enabled():  # the target's sessions yield the CPUs, serving's not
            wait_until(lambda: _weights(ours) == {YIELD_NICE}, "the target yielding", 10)
            assert _weights(theirs) == {0}
        # ...and are listed for the gateway to pause while a search runs (the recorded
        # rollout names no CLI on this host: none of its own); its searches pause them
        hold_file = running.cfg.run_dir / hold.HOLD_FILE
        gateway = next(c for c in theirs if c.name == "gateway")
        assert list(gateway.argv[gateway.argv.index("--hold-file") :][:2]) == [
            "--hold-file",
            str(hold_file),
        ]
        wanted = {c.pid: start_ticks(c.pid) for c in ours if c.pid is not None}
        wait_until(lambda: hold.read(hold_file) == wanted, "the target's shards listed", 10)
        # a catch-up that does not gain on the writes lifts the pause until it gains again
        client.set(HOLD_LIFTED_KEY, target.name, ex=60)
        wait_until(lambda: hold.read(hold_file) == {}, "the pause lifted", 10)
        client.delete(HOLD_LIFTED_KEY)
        wait_until(lambda: hold.read(hold_file) == wanted, "the target listed again", 10)
        holds = _metric(gateway, "gateway_rollout_holds_total")
        _search(gateway)
        assert _metric(gateway, "gateway_rollout_holds_total") > holds
        assert _metric(gateway, "gateway_rollout_held_seconds_total") > 0

        # the switch phase: the target is handed over to every CPU and to its full weight
        # before the alias names it (the builder waits for the record), while the budget
        # still holds
        client.hset(ROLLOUT_KEY, "phase", "switch")
        wait_until(
            lambda: _all_on(ours + theirs, every) and client.get(CPU_PLACED_KEY) == b"",
            f"{target.name}'s shards handed over to CPU {format_cpus(every)}",
            30,
        )
        if autogroup_enabled():
            assert _weights(ours) == {0} and _weights(theirs) == {0}
        assert hold.read(hold_file) == {}  # serving's now: never paused
        assert not any(_state(c.pid) == b"T" for c in ours if c.pid is not None)

        # the rollout ended: its CLI deletes the budget; every process stays on every CPU
        # (the stack's passes stop recording a placement: its 3-s record expires)
        registry.end_rollout()
        client.delete(CPU_BUDGET_KEY)
        wait_until(
            lambda: client.get(CPU_PLACED_KEY) is None,
            "the stack's passes without the budget",
            10,
        )
        assert _all_on(ours + theirs, every)
    finally:
        client.delete(CPU_BUDGET_KEY)
        registry.end_rollout()
        registry.set_state(target.name, "retired")
        wait_until(lambda: target.name not in running.addresses(), "its shards stopped", 60)


@pytest.mark.slow  # restarts the module's stack on its run directory: ~30 s
def test_a_rollout_target_comes_back_when_up_restarts(running: Running) -> None:
    target = new_generation(running, 2, trained=True)
    wait_until(lambda: target.name in running.addresses(), "the target's shards", 120)
    before = running.addresses()
    stop_stack(running.stack)

    running.stack = start_stack(running.cfg)  # `up` again on the same run directory
    assert set(running.addresses()) <= {"g1", target.name}  # no stale ports left published
    wait_until(
        lambda: running.addresses().get(target.name, before[target.name]) != before[target.name],
        "the target's shards started again and published on their new ports",
        120,
    )
    after = running.addresses()
    assert set(after) == {"g1", target.name}
    # stack.json is rewritten after the addresses are published in Redis (a pass later)
    wait_until(
        lambda: (
            (e := read_endpoints(running.cfg.run_dir)) is not None
            and e.generations.get(target.name) == parse_shard_addresses(after[target.name])
        ),
        "stack.json names the target's new ports",
        30,
    )
    endpoints = read_endpoints(running.cfg.run_dir)
    assert endpoints is not None
    assert all(grpc_healthy(a) for reps in endpoints.generations[target.name] for a in reps)

    # failed (an aborted rollout): its shards stop, its files are kept for inspection
    running.registry().set_state(target.name, "failed")
    wait_until(lambda: target.name not in running.addresses(), "stopped", 60)
    assert Path(target.index_dir).exists()


@pytest.mark.slow  # the module's last stack test (g1 retired): restarts up, ~30 s
def test_up_starts_again_once_g1_is_retired_for_a_generation_of_another_shard_count(
    running: Running,
) -> None:
    from services.client.gateway import Gateway, search_once

    target = new_generation(running, 3, trained=True)
    wait_until(lambda: target.name in running.addresses(), "the target's shards", 120)
    registry = running.registry()
    registry.switch(target.name, {})  # what the rollout's switch does to the alias
    snapshots = running.cfg.run_dir / "snapshots"
    assert list(snapshots.glob("shard-*-replica-*"))  # g1's
    registry.set_state("g1", "retired")
    wait_until(lambda: "g1" not in running.addresses(), "g1's shards stopped", 60)
    assert not list(snapshots.glob("shard-*-replica-*"))  # g1's snapshots went
    assert running.cfg.index_dir.exists()  # the stack's own index stays
    stop_stack(running.stack)

    # `up` again: the gateway needs the base shard count (2) but no g1 runs any more; it
    # is started without --shards (it reads the count from the store's key layout), not
    # with addresses made up in g1's place (the stack used to invent them)
    running.stack = start_stack(running.cfg)
    assert set(running.addresses()) == {target.name}
    (gateway,) = [c for c in running.stack.supervisor.children if c.name == "gateway"]
    assert "--shards" not in gateway.argv, gateway.argv
    endpoints = read_endpoints(running.cfg.run_dir)
    assert endpoints is not None and endpoints.shards == []
    response = search_once(Gateway(running.stack.endpoints.gateway), "anything", k=3, timeout=60)
    assert response.generation == target.name


def _ready_versions(url: str) -> list[str]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        return sorted(client.get_model_metadata("embed").versions)
    finally:
        client.close()


@pytest.mark.slow  # two Triton starts and a publish (export + parity check): ~1-2 min
def test_triton_of_up_loads_a_published_version_and_keeps_it_when_up_restarts(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from services.encoder.model import default_model_dir
    from services.encoder.serve.publish import publish_version

    base = encoder_base(tmp_path_factory)
    cfg = StackConfig(run_dir=tmp_path / "run", restart=FAST, startup_timeout_s=240)
    shutil.copytree(ensure_onnx(default_model_dir(), base).parent, cfg.run_dir / "export")
    said: list[str] = []

    def start_triton(sup: Supervisor) -> str:
        umask = os.umask(PRIVATE_UMASK)  # as `up` starts its children
        try:
            triton, url, _ = triton_component.triton_child(cfg, said.append)
            sup.start(triton, functools.partial(triton_component.triton_ready, url, "embed"), 240)
        finally:
            os.umask(umask)
        if autogroup_enabled():  # documents only (the gateway embeds queries): Triton's
            # session, its Python stubs included, waits behind the searches' work
            assert triton.pid is not None
            stubs = children_of(triton.pid)
            assert stubs, "no Python backend stub under Triton"
            for pid in (triton.pid, *stubs):
                assert group_nice(pid) == BACKGROUND_NICE, pid
        return url

    sup = Supervisor(cfg.restart)
    try:
        url = start_triton(sup)
        g1 = first_run.encoder_spec(cfg, url)  # what `up` records for g1: version 1, pinned
        assert (g1.model, g1.version, g1.dim) == ("embed", 1, DIM) and g1.digest
        published = publish_version(cfg.model_repository, ensure_second_encoder(base), url)
        assert published.version == 2 and published.digest != g1.digest
        assert _ready_versions(url) == ["1", "2"]  # loaded while it served
        # at rest (issue #33 point 3): the model code and Triton's backend, copied with
        # their sources' modes whatever `up`'s umask, and the version published under
        # this process's (022), are the owner's only
        for root in (cfg.model_repository, cfg.run_dir / "triton-backends"):
            assert not_private(root) == [], root
    finally:
        sup.stop_all()

    sup = Supervisor(cfg.restart)  # `up` again on the same run directory
    try:
        url = start_triton(sup)
        assert _ready_versions(url) == ["1", "2"]  # regenerating would have dropped 2
        assert any("keeping" in line and "[1, 2]" in line for line in said)
        assert first_run.encoder_spec(cfg, url).version == 2  # the newest, for a new record
    finally:
        sup.stop_all()
