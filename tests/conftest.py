"""Fixtures shared by every test: real servers on free ports."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import RedisServer, redis_binary, run_redis, wait_until
from tests.support.redis_cluster import RedisCluster, run_redis_cluster

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    """Hypothesis without its per-example deadline (200 ms by default): on a loaded CI
    machine a stall fails an example for its wall time, not for what the property says.
    The examples' number and the health checks stay hypothesis's defaults."""
    from hypothesis import settings

    settings.register_profile("gtr", deadline=None)
    settings.load_profile("gtr")


SHARED_DATA = Path(
    os.environ.get("GTR_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data")
)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session; tests isolate themselves by key prefix or FLUSHDB."""
    if redis_binary() is None:
        pytest.fail("redis-server is not installed (scripts/bootstrap.sh installs it)")
    with run_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A clean database on the session's Redis for one test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield redis_server.url
    client.flushdb()
    client.close()


@pytest.fixture(scope="module")
def module_redis(redis_server: RedisServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """A database of the session's Redis for a whole module (servers started once per module
    keep their data past the per-test flush of db 0 that ``redis_url`` does): the module names
    its own database in ``REDIS_DB`` (1-15, one per module); flushed before and after."""
    import redis

    db = getattr(request.module, "REDIS_DB", None)
    if not isinstance(db, int) or not 1 <= db <= 15:
        pytest.fail(f"{request.module.__name__} uses module_redis without REDIS_DB = 1..15")
    url = f"redis://127.0.0.1:{redis_server.port}/{db}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """One real Redis Cluster for the session: 3 primaries + 3 replicas (AOF, fsync always)."""
    if redis_binary() is None:
        pytest.fail("redis-server is not installed (scripts/bootstrap.sh installs it)")
    with run_redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(params=["single", "cluster"])
def any_redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A clean store on one Redis, then on a 3-primary Redis Cluster: a test that takes it
    runs once on each (its id ends in ``[single]`` / ``[cluster]``)."""
    if request.param == "single":
        yield request.getfixturevalue("redis_url")
        return
    cluster: RedisCluster = request.getfixturevalue("redis_cluster")
    wait_until(cluster.healthy, "cluster_state:ok with every replica in sync", timeout=60)
    cluster.flush()
    yield cluster.url
    cluster.flush()


@pytest.fixture(scope="session")
def scifact_dir() -> Path:
    path = SHARED_DATA / "scifact"
    if not (path / "corpus.jsonl").exists():
        pytest.fail(f"SciFact data not found at {path}: the tests need it (set GTR_DATA_DIR)")
    return path
