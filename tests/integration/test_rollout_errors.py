"""Bad input to `index rollout | rollback | retire | generations` on a real Redis, driven
through the command line as an operator runs it: each a clear error with the right
domain error (FAILED_PRECONDITION / NOT_FOUND over gRPC, exit status 2 on the command
line) and nothing changed; --abort of an interrupted rollout puts the writes back."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.cli.main import main
from services.common.errors import FailedPrecondition, NotFound
from services.generations.lifecycle import retire
from services.generations.registry import EncoderSpec, Generation, Registry
from services.index.keys import CLOSED, LAYOUT_KEY, Layout
from services.process.redis_client import sync_client
from services.rpc.status import status_of

SPEC = EncoderSpec("embed", 1, 384, "minilm")
BASE = Layout(2, 2)


@pytest.fixture
def store(redis_url: str) -> Iterator[Any]:
    client = sync_client(redis_url)
    client.hset(LAYOUT_KEY, mapping={"version": "2", "shards": "2"})
    Registry(client).ensure_first(2, SPEC, "")
    yield client
    client.close()


def _dump(client: Any) -> dict[bytes, Any]:
    """Every key and its content: 'nothing changed' is this, before and after."""
    out: dict[bytes, Any] = {}
    for key in sorted(client.scan_iter(count=1000)):
        kind = client.type(key)
        out[key] = client.hgetall(key) if kind == b"hash" else client.dump(key)
    return out


@contextmanager
def _unchanged(client: Any) -> Iterator[None]:
    """The store holds key for key what it held before the block."""
    before = _dump(client)
    yield
    assert _dump(client) == before


@dataclass
class Cli:
    """`gtr-retrieval index ...` against the test's Redis, run as an operator runs it."""

    redis_url: str
    capsys: pytest.CaptureFixture[str]

    def ok(self, *argv: str) -> str:
        """Exit status 0; what it printed on stdout."""
        assert main(["index", *argv, "--redis-url", self.redis_url]) == 0
        return self.capsys.readouterr().out

    def refused(self, *argv: str, says: str) -> str:
        """Exit status 2 (a domain error) and `says` in what it printed on stderr, which
        is returned."""
        assert main(["index", *argv, "--redis-url", self.redis_url]) == 2
        err = self.capsys.readouterr().err
        assert says in err, err
        return err


@pytest.fixture
def cli(redis_url: str, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(redis_url, capsys)


def _recorded(client: Any, *, alive: bool) -> None:
    """A rollout g1 -> g2 in its bulk phase, its builder alive (this process, beating) or
    gone (a pid that is not running, silent for a minute)."""
    registry = Registry(client)
    client.incr("{gtr}:next")
    registry.put(Generation("g2", "building", 2, SPEC, "/nowhere/g2", {"trained": True}))
    beat = time.time() if alive else time.time() - 60
    registry.begin_rollout(
        {
            "target": "g2",
            "source": "g1",
            "kind": "rollout",
            "mode": "encode",
            "phase": "bulk",
            "host": socket.gethostname(),
            "pid": str(os.getpid() if alive else 2**22 + 7),
            "beat": repr(beat),
            "owner": "someone",
            "plan": json.dumps({"encoder": SPEC.__dict__, "shards": 2, "retrain": False}),
            "p0": "{}",
            "positions": "{}",
        }
    )


def test_a_second_rollout_while_one_runs_is_refused_naming_it(store: Any, cli: Cli) -> None:
    _recorded(store, alive=True)
    with _unchanged(store):
        err = cli.refused(
            "rollout", "--yes", "--shards", "3", says="a rollout to g2 is running (phase bulk"
        )
    assert f"pid {os.getpid()}" in err


def test_an_interrupted_rollout_is_not_replaced_by_another_one(store: Any, cli: Cli) -> None:
    _recorded(store, alive=False)
    with _unchanged(store):
        cli.refused(
            "rollout",
            "--yes",
            "--shards",
            "3",
            says="was interrupted (phase bulk) with other options: resume it with `index rollout`",
        )


def test_abort_of_an_interrupted_rollout_gives_the_writes_back_to_the_source(
    store: Any, cli: Cli
) -> None:
    _recorded(store, alive=False)
    registry = Registry(store)
    registry.set_gates(BASE, CLOSED)  # it died mid-switch: writes paused
    store.hset("snap:{0}", "rollout:g2", "5-0")  # its hold on the source's log
    assert "aborted the rollout to g2" in cli.ok("rollout", "--abort")
    assert registry.running() is None
    assert registry.get("g2").state == "failed"
    assert {registry.gate(BASE, s) for s in range(2)} == {"g1"}
    assert store.hget("snap:{0}", "rollout:g2") is None
    assert registry.alias().serving == "g1"
    # Nothing left to abort: a clear error.
    cli.refused("rollout", "--abort", says="no rollout is running")


def test_rollback_with_no_previous_generation_is_refused(store: Any, cli: Cli) -> None:
    with _unchanged(store):
        cli.refused("rollback", "--yes", says="no previous generation to roll back to")


def test_retire_of_the_serving_generation_is_refused(store: Any, cli: Cli) -> None:
    with _unchanged(store):
        cli.refused("retire", "--generation", "g1", "--yes", says="g1 is the serving generation")
        with pytest.raises(FailedPrecondition) as caught:
            retire(store, "g1")
    assert status_of(caught.value) is grpc.StatusCode.FAILED_PRECONDITION


def test_retire_or_rollback_of_an_unknown_generation_is_not_found(store: Any, cli: Cli) -> None:
    with _unchanged(store):
        cli.refused("retire", "--generation", "g9", "--yes", says="generation 'g9' does not exist")
        with pytest.raises(NotFound) as caught:
            retire(store, "g9")
        # A previous generation the alias names but the registry lost: rollback says so.
        store.hset("{gtr}:alias", "previous", "g7")
        cli.refused("rollback", "--yes", says="generation 'g7' does not exist")
        store.hdel("{gtr}:alias", "previous")
    assert status_of(caught.value) is grpc.StatusCode.NOT_FOUND


def test_retrain_without_the_source_replicas_or_encoder_without_a_repository_changes_nothing(
    store: Any, cli: Cli, tmp_path: Path
) -> None:
    run_dir = ("--run-dir", str(tmp_path))
    with _unchanged(store):
        cli.refused("rollout", "--yes", "--retrain", *run_dir, says="give --source-shards")
        cli.refused(
            "rollout",
            "--yes",
            "--encoder",
            str(tmp_path),
            *run_dir,
            says="no Triton model repository",
        )


def test_generations_lists_the_registry(store: Any, cli: Cli) -> None:
    _recorded(store, alive=True)
    listed = json.loads(cli.ok("generations", "--json"))
    assert [(g["name"], g["state"], g["alias"]) for g in listed["generations"]] == [
        ("g1", "serving", "serving"),
        ("g2", "building", ""),
    ]
    assert listed["rollout"]["phase"] == "bulk" and listed["alias"]["epoch"] == 1
    table = cli.ok("generations")
    assert "g1    serving" in table and "rollout g1 -> g2 (rollout, encode): phase bulk" in table


def test_a_builder_of_another_host_counts_as_gone_once_its_heartbeat_stops(store: Any) -> None:
    """A Job's replacement pod (another host) resumes the rollout of the pod before it once
    that one's heartbeat is older than stale_after_s; while it beats, it is refused."""
    from services.generations.builder import RolloutBuilder, RolloutOptions, RolloutPlan

    _recorded(store, alive=True)
    store.hset("{gtr}:rollout", mapping={"host": "rollout-pod-0", "beat": repr(time.time())})
    options = RolloutOptions(index_root=Path("unused"), stale_after_s=1.0, heartbeat_s=0.2)
    builder = RolloutBuilder(store, _no_encoder, options)
    running = Registry(store).running()
    assert running is not None
    started = time.monotonic()
    builder.check_resumable(running, RolloutPlan())  # returns: the other pod went silent
    assert time.monotonic() - started < 3.0
    # A pod that still beats: refused, naming it.
    beating = threading.Event()

    def beat() -> None:
        while not beating.is_set():
            store.hset("{gtr}:rollout", "beat", repr(time.time()))
            beating.wait(0.1)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        with pytest.raises(FailedPrecondition, match=r"builder pid .* on rollout-pod-0"):
            builder.check_resumable(Registry(store).running() or running, RolloutPlan())
    finally:
        beating.set()
        thread.join()


async def _no_encoder(spec: Any) -> Any:
    raise AssertionError("no encoder is needed to check a rollout")


def test_abort_is_refused_while_the_builder_runs(store: Any, cli: Cli) -> None:
    """A live builder could switch the alias after --abort gave the writes back."""
    _recorded(store, alive=True)
    with _unchanged(store):
        cli.refused("rollout", "--abort", says="a rollout to g2 is running")


def test_the_run_dir_of_a_local_stack_names_the_store(
    store: Any, redis_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--run-dir` reads stack.json as the other client commands do: the Redis URL from
    its URL file (password and all), nothing on the command line."""
    url_file = tmp_path / "redis.url"
    url_file.write_text(redis_url + "\n")
    (tmp_path / "stack.json").write_text(
        json.dumps(
            {
                "redis_url": "redis://127.0.0.1:1/0",
                "redis_url_file": str(url_file),
                "index_root": str(tmp_path / "generations"),
            }
        )
    )
    assert main(["index", "generations", "--json", "--run-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["alias"]["serving"] == "g1"
    # No stack there and no --redis-url: said so.
    assert main(["index", "generations", "--run-dir", str(tmp_path / "none")]) == 2
    assert "no store: give --redis-url" in capsys.readouterr().err


def test_a_publish_that_fails_outside_the_domain_errors_ends_the_rollout(
    store: Any, tmp_path: Path
) -> None:
    """The export of --encoder can fail with what no domain error covers (a full disk,
    torch): the publish phase held only the lock, so it gives the lock back and nothing
    is left to resume or abort (as for a refused publish)."""
    import asyncio

    from services.generations.builder import RolloutBuilder, RolloutOptions, RolloutPlan

    def full_disk(folder: str, int8_unmeasured: bool) -> EncoderSpec:
        raise OSError(28, "No space left on device", folder)

    options = RolloutOptions(index_root=tmp_path / "generations")
    builder = RolloutBuilder(store, _no_encoder, options, publisher=full_disk)
    with pytest.raises(OSError, match="No space left"):
        asyncio.run(builder.rollout(RolloutPlan(encoder_dir=str(tmp_path))))
    registry = Registry(store)
    assert registry.running() is None
    assert registry.serving().name == "g1"


@pytest.mark.parametrize(
    ("plan", "starts"),
    [
        (
            {"retrain": True, "encoder_dir": "/checkpoints/new"},
            "--retrain reuses the serving encoder's vectors",
        ),
        ({"num_shards": -1}, "--shards -1: at least 1"),
    ],
)
def test_a_plan_the_builder_refuses_is_worded_with_its_flag_first(
    store: Any, tmp_path: Path, plan: dict[str, Any], starts: str
) -> None:
    """The builder's PlanRefused names no flag; the CLI's wording puts the flag first."""
    import asyncio

    from services.cli.generation_places import in_flags
    from services.common.errors import InvalidArgument
    from services.generations.builder import RolloutBuilder, RolloutOptions, RolloutPlan

    async def no_encoder(spec: EncoderSpec) -> Any:
        raise AssertionError("a refused plan encodes nothing")

    builder = RolloutBuilder(store, no_encoder, RolloutOptions(index_root=tmp_path))
    with _unchanged(store), pytest.raises(InvalidArgument) as refused, in_flags():
        asyncio.run(builder.rollout(RolloutPlan(**plan)))
    assert refused.value.message.startswith(starts), refused.value.message
