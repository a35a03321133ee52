"""The container images, built here and run: the stack from the images answers a search.

``scripts/build_images.sh`` builds the CPU images (buildah with vfs and chroot isolation
where there is no Docker daemon, as on CI); then, from those images only:

1. the application image's CLI exports all-MiniLM-L6-v2 to ONNX, writes the CPU Triton
   model repository and trains the IVF-PQ index (SciFact embeddings);
2. the CPU Triton image serves that repository (ready on HTTP /v2/health/ready);
3. the application image runs an index shard and the gateway;

each on free loopback ports with the host's network. The test then drives the gateway
over gRPC as a client would: Upsert, then a SESSION search finds the document. Redis is
the test session's redis-server: the chart runs the upstream Redis image, which is not
built here. Containers are removed at the end, also on failure.

Slow (the image build: ~5 min on 2 cores with a cold cache), run by CI. buildah and
mmdebstrap are installed by scripts/bootstrap.sh: missing, the test fails.
GTR_TEST_IMAGES_BUILT=1 runs the stack from images already built (by the script, just
before) without building them again: for iterating on this test only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from retrieval.v1 import common_pb2, documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
from tests.support.containers import BUILD_SCRIPT, Container, docker_works, image_refs
from tests.support.processes import RedisServer, free_port
from tests.support.sample_docs import STDLIB_DOCS

pytestmark = pytest.mark.slow

BUILD_TIMEOUT_S = 1200
START_TIMEOUT_S = 180

DOCS = STDLIB_DOCS


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """Build the CPU images with the build script (cached base and wheelhouse are reused)."""
    docker = docker_works()
    if not docker:
        missing = [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]
        if missing:
            pytest.fail(f"{', '.join(missing)} not installed (scripts/bootstrap.sh installs them)")
    if os.environ.get("GTR_TEST_IMAGES_BUILT") != "1":
        started = time.monotonic()
        proc = subprocess.run(
            [str(BUILD_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        output = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        assert proc.returncode == 0, f"build_images.sh failed:\n{output}"
        print(f"images built in {time.monotonic() - started:.0f} s\n{proc.stdout}")
    refs = image_refs()
    return {"APP": refs["APP"], "TRITON_CPU": refs["TRITON_CPU"], "docker": str(docker)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared with the containers, whose user (10001) must write into it."""
    root = tmp_path_factory.mktemp("images")
    root.chmod(0o777)
    return root


@pytest.fixture(scope="module")
def containers(images: dict[str, str]) -> Iterator[dict[str, Container]]:
    """One container of each image. The shard, the gateway and the CLI commands run as
    separate processes in the application image's container (with vfs every container is
    a full copy of its image: one of 2.5 GB is enough)."""
    docker = images["docker"] == "True"
    made: dict[str, Container] = {}
    try:
        for role, image in (("app", "APP"), ("triton", "TRITON_CPU")):
            made[role] = Container(images[image], docker=docker)
        yield made
    finally:
        for container in made.values():
            container.remove()


def wait_until(check: object, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        if check():  # type: ignore[operator]
            return
        time.sleep(0.3)
    raise AssertionError(f"{what} not ready in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def http_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def grpc_serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def test_the_stack_from_the_images_answers_a_search(
    containers: dict[str, Container],
    workdir: Path,
    scifact_dir: Path,
    redis_server: RedisServer,
) -> None:
    work = {workdir: "/work"}
    app = containers["app"]
    # 1. Artefacts, made by the application image's CLI.
    np.save(workdir / "emb.npy", np.load(scifact_dir / "corpus.all-MiniLM-L6-v2.npy")[:3000])
    app.run(
        ["encoder", "export", "--out", "/work/export/model.onnx", "--skip-parity"],
        timeout=600,
        volumes=work,
    )
    app.run(
        [
            "encoder",
            "repo",
            "--onnx",
            "/work/export/model.onnx",
            "--out",
            "/work/repo",
            "--flavor",
            "cpu",
            "--threads",
            "1",
        ],
        timeout=120,
        volumes=work,
    )
    app.run(
        [
            "index",
            "train",
            "--embeddings",
            "/work/emb.npy",
            "--out",
            "/work/index",
            "--model",
            "all-MiniLM-L6-v2",
        ],
        timeout=600,
        volumes=work,
    )
    assert json.loads((workdir / "index" / "manifest.json").read_text())["dim"] == 384
    # Writable by the image's user (uid 10001): the shard creates its text index there
    # at start (mkdir's mode is masked by the umask, hence the chmod).
    (workdir / "snap").mkdir()
    (workdir / "snap").chmod(0o777)

    # 2. Triton (CPU image) serving the repository.
    http, grpc_port, metrics = free_port(), free_port(), free_port()
    triton_log = workdir / "triton.log"
    triton = containers["triton"].start(
        [
            "--model-repository=/work/repo",
            f"--http-port={http}",
            f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics}",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--strict-readiness=true",
            "--exit-on-error=true",
            "--allow-gpu-metrics=false",
        ],
        triton_log,
        volumes=work,
    )
    wait_until(lambda: http_ready(http), "tritonserver", triton, triton_log)

    # 3. One shard and the gateway (application image).
    shard_port = free_port()
    shard_log = workdir / "shard.log"
    shard = app.start(
        [
            "index",
            "serve",
            f"--port={shard_port}",
            "--shard=0",
            "--shards=1",
            f"--redis-url={redis_server.url}",
            "--index-dir=/work/index",
            "--snapshot-dir=/work/snap",
        ],
        shard_log,
        volumes=work,
    )
    wait_until(lambda: grpc_serving(shard_port), "index shard", shard, shard_log)

    gateway_port = free_port()
    gateway_log = workdir / "gateway.log"
    gateway_help = app.run(["gateway", "serve", "--help"], timeout=60)
    auth = ["--no-auth"] if "--no-auth" in gateway_help else []
    gateway = app.start(
        [
            "gateway",
            "serve",
            f"--port={gateway_port}",
            f"--redis-url={redis_server.url}",
            f"--shards=127.0.0.1:{shard_port}",
            f"--triton-url=127.0.0.1:{grpc_port}",
            *auth,
        ],
        gateway_log,
    )
    wait_until(lambda: grpc_serving(gateway_port), "gateway", gateway, gateway_log)

    # The image's HEALTHCHECK command, run in the container against the gateway.
    health = app.config()["Healthcheck"]["Test"]  # type: ignore[index]
    assert health[0] == "CMD"
    app.run(health[1:], timeout=60, env={"GTR_HEALTH_PORT": str(gateway_port)}, entrypoint=False)
    assert app.config()["User"] == "10001:10001"
    assert containers["triton"].config()["User"] == "10001:10001"

    # 4. A client: upsert, then search finds it.
    with grpc.insecure_channel(f"127.0.0.1:{gateway_port}") as channel:
        documents = documents_pb2_grpc.DocumentServiceStub(channel)
        search = search_pb2_grpc.SearchServiceStub(channel)
        up = documents.Upsert(
            documents_pb2.UpsertRequest(
                documents=[documents_pb2.Document(id=i, title=t, text=x) for i, t, x in DOCS]
            ),
            timeout=60,
        )
        assert up.upserted == len(DOCS)
        reply = search.Search(
            search_pb2.SearchRequest(
                query="how do I read a csv file",
                k=3,
                consistency=common_pb2.CONSISTENCY_SESSION,
                write_token=up.write_token,
            ),
            timeout=60,
        )
    assert [h.id for h in reply.hits][:1] == ["py-csv"], reply
    assert reply.hits[0].title == "csv.reader"
    assert reply.model == "all-MiniLM-L6-v2"
    assert not reply.partial
