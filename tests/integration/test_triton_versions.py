"""Two encoder versions served side by side by one real tritonserver (issue #24).

The repository starts with all-MiniLM-L6-v2 as version 1 of ``embed``; while Triton
serves it, ``publish_version`` adds a different encoder (MiniLM with perturbed weights,
``tests/support/encoders.py``) as version 2 and the running server loads it (explicit
model control, no restart). Both versions answer, each with its own model's vectors;
a 768-d encoder is refused with FAILED_PRECONDITION and changes nothing. One server for
the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.encoder.build.export import row_cosines
from services.encoder.build.repository import RepositoryConfig, generate_repository, read_config
from services.encoder.model import default_model_dir
from services.encoder.profiles import Kind
from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig
from services.encoder.serve.publish import publish_version
from services.encoder.serve.triton_load import load_model
from services.encoder.serve.triton_server import TritonHandle, TritonServerConfig, run_triton
from services.encoder.serve.unpublish import unpublish_version
from services.encoder.serve.versions import clear_cpu_budgets, describe_versions, served_versions
from services.generations.state import RolloutState
from services.process.private import make_private
from services.rpc.status import status_of
from tests.encoder_fixtures import (
    SAMPLE_DOCUMENTS,
    SAMPLE_QUERIES,
    encoder_base,
    ensure_onnx,
    torch_embedder,
)
from tests.support.encoders import ensure_second_encoder
from tests.support.processes import free_port, wait_until

# The whole module is slow (about 6 min on two cores) and its tests build on each other: the
# versions one publishes are the repository the next ones copy or unpublish.
pytestmark = pytest.mark.slow

SAMPLES: list[tuple[list[str], Kind]] = [
    (SAMPLE_QUERIES, "query"),
    (SAMPLE_DOCUMENTS, "document"),
]


@dataclass
class Served:
    handle: TritonHandle
    repo: Path
    base: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = encoder_base(tmp_path_factory)
    repo = tmp_path_factory.mktemp("versions") / "repo"
    generate_repository(
        ensure_onnx(default_model_dir(), base),
        repo,
        RepositoryConfig(instances=1, intra_op_threads=1),
    )
    cfg = TritonServerConfig(
        repo,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        startup_timeout_s=90,
    )
    with run_triton(cfg, repo.parent / "triton.log") as handle:
        yield Served(handle, repo, base)


async def _encode_all(url: str, version: str) -> tuple[TritonEncoder, dict[Kind, np.ndarray]]:
    encoder = await TritonEncoder.connect(TritonEncoderConfig(url, model_version=version))
    try:
        got = {
            kind: (await encoder.encode(texts, kind, timeout=30)).vectors for texts, kind in SAMPLES
        }
    finally:
        await encoder.close()
    return encoder, got


def _recorded(registry: Any) -> RolloutState:
    """The rollout ``{gtr}:rollout`` records (an empty record when none runs)."""
    return registry.running() or RolloutState(target="")


def _expected(model_dir: Path) -> dict[Kind, np.ndarray]:
    reference = torch_embedder(model_dir)
    return {kind: reference.embed(texts, kind)[0] for texts, kind in SAMPLES}


def _ready_versions(handle: TritonHandle) -> list[str]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(handle.grpc_url)
    try:
        return sorted(client.get_model_metadata("embed").versions)
    finally:
        client.close()


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (lock file aside) → the SHA-256 of its bytes."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".publish.lock"]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_a_second_encoder_is_published_and_served_beside_the_first(served: Served) -> None:
    url = served.handle.grpc_url
    second = ensure_second_encoder(served.base)
    want_first, want_second = _expected(default_model_dir()), _expected(second)
    config_before = (served.repo / "embed" / "config.pbtxt").read_bytes()
    first_stubs = _stubs(served.handle, served.repo, 1)
    assert len(first_stubs) == 1  # one instance (RepositoryConfig(instances=1))

    async def go() -> None:
        # a client connected before the publish: pinned to version 1, the newest then
        early = await TritonEncoder.connect(TritonEncoderConfig(url))
        try:
            assert (early.model_version, early.model_name) == (1, "all-MiniLM-L6-v2")
            publishing = asyncio.ensure_future(
                asyncio.to_thread(publish_version, served.repo, second, url)
            )
            answered = 0  # version 1 answers all along, from the same stub
            while not publishing.done():
                await early.encode(["during the publish"], "query", timeout=30)
                now = _stubs(served.handle, served.repo, 1)
                assert now == first_stubs, f"version 1 reloaded: stubs {first_stubs} -> {now}"
                answered += 1
            spec = await publishing
            assert answered > 0
            # Triton loaded version 2 only: version 1 was not reloaded (a reload starts a
            # new stub, then stops the old one), because config.pbtxt did not change
            assert _stubs(served.handle, served.repo, 1) == first_stubs, (
                "publishing version 2 reloaded version 1"
            )
            assert len(_stubs(served.handle, served.repo, 2)) == 1
            assert (served.repo / "embed" / "config.pbtxt").read_bytes() == config_before
            assert (spec.model, spec.version, spec.dim) == ("embed", 2, 384)
            assert served_versions(served.repo) == [1, 2]
            assert _ready_versions(served.handle) == ["1", "2"]  # loaded, no restart
            # and the next load (the next rollout's publish) reloads neither: nothing the
            # publish left behind (its temporary export, removed) touches version 2's files
            stubs = [_stubs(served.handle, served.repo, v) for v in (1, 2)]
            await asyncio.to_thread(load_model, url, None, None)
            assert [_stubs(served.handle, served.repo, v) for v in (1, 2)] == stubs
            # the early client keeps version 1's vectors
            kept = (await early.encode(SAMPLE_QUERIES, "query", timeout=30)).vectors
            assert min(row_cosines(kept, want_first["query"])) >= 0.999
        finally:
            await early.close()

        first_enc, first = await _encode_all(url, "1")
        second_enc, got = await _encode_all(url, "2")
        assert second_enc.model_name == "all-MiniLM-L6-v2-perturbed"
        assert (second_enc.digest, second_enc.model_version) == (spec.digest, 2)
        assert first_enc.digest and first_enc.digest != spec.digest
        for _, kind in SAMPLES:  # each version answers with its own model
            assert min(row_cosines(first[kind], want_first[kind])) >= 0.999
            assert min(row_cosines(got[kind], want_second[kind])) >= 0.999
            assert min(row_cosines(first[kind], got[kind])) < 0.99  # and they differ

        newest = await TritonEncoder.connect(TritonEncoderConfig(url))
        await newest.close()
        assert newest.model_version == 2  # a client connecting now pins the newest

    asyncio.run(go())
    loads = _load_count(served.handle)
    again = publish_version(served.repo, second, url)  # the same export: nothing added
    assert (again.version, again.dim) == (2, 384)
    assert served_versions(served.repo) == [1, 2]
    assert _load_count(served.handle) == loads  # and nothing reloaded


def _stubs(handle: TritonHandle, repo: Path, version: int) -> list[int]:
    """The pids of Triton's Python backend stubs that run ``version`` of ``embed``: argv
    ``triton_python_backend_stub <repo>/embed/<version>/model.py ...``, read from /proc
    (as services/generations/placement.py ``stub_budget_age`` reads it). A reload of the
    version starts a new stub before the old one stops."""
    from services.process.cpus import children_of, cmdline

    script = str(repo.resolve() / "embed" / str(version) / "model.py")
    return sorted(
        pid
        for pid in children_of(handle.process.pid)
        if (argv := cmdline(pid))[:1]
        and argv[0].endswith("triton_python_backend_stub")
        and argv[1:2] == [script]
    )


def _load_count(handle: TritonHandle) -> int:
    """How many times Triton's log says it loaded ``embed``."""
    return handle.log_path.read_text(errors="replace").count("successfully loaded 'embed'")


def test_a_version_published_into_a_private_repository_is_private(
    served: Served, tmp_path: Path
) -> None:
    """The local stack keeps its run directory, the model repository included, for its
    owner (issue #33 point 3); `index rollout --encoder` publishes into it under its own
    user's umask, which made the new version's graphs and tokenizer 0644 in 0755 folders.
    A repository kept private gets a private version; another keeps the umask's modes."""
    repos = {}
    for name, private in (("private", True), ("shared", False)):
        repo = tmp_path / name / "repo"
        generate_repository(
            ensure_onnx(default_model_dir(), served.base), repo, RepositoryConfig(instances=1)
        )
        if private:
            make_private(repo)
        repos[name] = repo
    second = ensure_second_encoder(served.base)
    umask = os.umask(0o022)  # an operator's shell
    try:
        for repo in repos.values():
            assert publish_version(repo, second).version == 2
    finally:
        os.umask(umask)
    version = repos["private"] / "embed" / "2"
    paths = [version, *version.rglob("*")]
    assert len(paths) > 5  # the graphs, the tokenizer, the model code...
    for path in paths:
        want = 0o700 if path.is_dir() else 0o600
        assert stat.S_IMODE(path.stat().st_mode) == want, (path, oct(path.stat().st_mode))
    shared = repos["shared"] / "embed" / "2"
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert stat.S_IMODE((shared / "tokenizer.json").stat().st_mode) & 0o044 == 0o044


def test_an_encoder_of_another_width_is_refused_and_nothing_changes(served: Served) -> None:
    wide = ensure_second_encoder(served.base, out_dim=768)
    before, ready = _snapshot(served.repo), _ready_versions(served.handle)
    with pytest.raises(FailedPrecondition, match=r"768 dimensions.*EMBEDDING \[384\]") as info:
        publish_version(served.repo, wide, served.handle.grpc_url)
    assert status_of(info.value) == grpc.StatusCode.FAILED_PRECONDITION
    assert "needs a Triton model of its own" in info.value.message
    assert _snapshot(served.repo) == before
    assert _ready_versions(served.handle) == ready


def test_publish_cli_refuses_a_repository_without_embed(tmp_path: Path) -> None:
    """The command's exit status and message for a user mistake (no traceback)."""
    shutil.rmtree(tmp_path / "empty", ignore_errors=True)
    (tmp_path / "empty").mkdir()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "encoder",
            "publish",
            "--repo",
            str(tmp_path / "empty"),
            "--model-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "has no embed model: generate the repository first" in run.stderr


def test_the_gpu_flavour_is_refused_and_nothing_changes(served: Served, tmp_path: Path) -> None:
    """An ensemble names one version of each step: publish says so instead of writing a
    version it cannot route to (an ``encoder export`` folder is taken as the encoder)."""
    repo = tmp_path / "gpu-repo"
    generate_repository(
        ensure_onnx(default_model_dir(), served.base), repo, RepositoryConfig(flavor="gpu")
    )
    export = ensure_onnx(ensure_second_encoder(served.base), served.base).parent
    before = _snapshot(repo)
    with pytest.raises(FailedPrecondition, match=r"gpu flavour .* cannot serve a second encoder"):
        publish_version(repo, export)
    assert _snapshot(repo) == before


def test_a_publish_triton_cannot_load_is_undone(served: Served) -> None:
    """All or nothing: when the Triton to load it cannot be asked, the new version's
    folder and parameters are taken back out (the serving Triton never saw them)."""
    third = ensure_second_encoder(served.base, seed=3)  # not published: a new version
    export = ensure_onnx(third, served.base).parent
    before, ready = _snapshot(served.repo), _ready_versions(served.handle)
    nobody = f"127.0.0.1:{free_port()}"
    # the serving Triton loads it, the second cannot be asked: both are put back
    with pytest.raises(Unavailable, match=f"Triton at {nobody} could not be asked"):
        publish_version(served.repo, export, f"{served.handle.grpc_url},{nobody}")
    assert _snapshot(served.repo) == before
    assert not list((served.repo / "embed").glob(".staging-*"))
    assert _ready_versions(served.handle) == ready


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", "encoder", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_version_is_unpublished_from_the_repository_and_the_running_triton(
    served: Served,
) -> None:
    """Through the CLI, as an operator would: an encoder no generation uses any more
    leaves Triton (its memory freed) while the versions left keep answering; an unknown
    version is NOT_FOUND (exit 2, no traceback)."""
    third = ensure_onnx(ensure_second_encoder(served.base, seed=3), served.base).parent
    url, repo = served.handle.grpc_url, str(served.repo)
    run = _cli("publish", "--repo", repo, "--triton-url", url, "--model-dir", str(third), "--json")
    assert run.returncode == 0, run.stderr
    version = json.loads(run.stdout)["version"]
    assert _ready_versions(served.handle)[-1] == str(version)
    listed = json.loads(_cli("versions", "--repo", repo, "--json").stdout)
    assert [v["version"] for v in listed] == served_versions(served.repo)
    assert [s.version for s in describe_versions(served.repo)][-1] == version

    first_stubs = _stubs(served.handle, served.repo, 1)
    # what a publish killed while staging leaves: gone before the load, or Triton would
    # reload every version (a non-version entry newer than their load)
    stale = served.repo / "embed" / ".staging-99"
    shutil.copytree(served.repo / "embed" / str(version), stale)
    run = _cli("unpublish", "--repo", repo, "--triton-url", url, "--version", str(version))
    assert run.returncode == 0, run.stderr
    assert _stubs(served.handle, served.repo, 1) == first_stubs  # not reloaded
    assert not stale.exists()
    assert str(version) not in _ready_versions(served.handle)
    assert version not in served_versions(served.repo)
    assert not list((served.repo / "embed").glob(".retired-*"))
    params = read_config(served.repo / "embed" / "config.pbtxt").parameters
    assert not [k for k in params if k.startswith(f"version.{version}.")]
    _, got = asyncio.run(_encode_all(url, "1"))  # the first version still answers
    assert min(row_cosines(got["query"], _expected(default_model_dir())["query"])) >= 0.999

    run = _cli("unpublish", "--repo", repo, "--version", "99")
    assert run.returncode == 2 and "has no version 99" in run.stderr
    with pytest.raises(NotFound):
        unpublish_version(served.repo, 99)


def test_the_last_version_stays(served: Served, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    generate_repository(ensure_onnx(default_model_dir(), served.base), repo)
    with pytest.raises(FailedPrecondition, match="only version") as info:
        unpublish_version(repo, 1)
    assert status_of(info.value) == grpc.StatusCode.FAILED_PRECONDITION
    assert served_versions(repo) == [1]


def test_an_unpublish_stopped_midway_is_finished_by_the_next_one(
    served: Served, tmp_path: Path
) -> None:
    """An unpublish killed inside its folder removal leaves the policy `specific` and a
    half-deleted numbered folder: the next unpublish finishes it (the folder goes, the
    policy is `all`) instead of taking it for a version and putting it back in the policy."""
    repo = tmp_path / "repo"
    shutil.copytree(served.repo, repo)
    model = repo / "embed"
    versions = served_versions(repo)
    for extra in range(versions[-1] + 1, versions[-1] + 3):  # two more, copies of the first
        shutil.copytree(model / str(versions[0]), model / str(extra))
    *kept, stopped, last = served_versions(repo)
    from google.protobuf import text_format

    config = read_config(model / "config.pbtxt")
    config.version_policy.specific.versions[:] = [*kept, last]  # as the unpublish wrote it
    (model / "config.pbtxt").write_text(text_format.MessageToString(config))
    for path in sorted((model / str(stopped)).iterdir())[:1]:  # then stopped in its rmtree
        shutil.rmtree(path) if path.is_dir() else path.unlink()

    unpublish_version(repo, last)
    assert served_versions(repo) == kept
    assert read_config(model / "config.pbtxt").version_policy.WhichOneof("policy_choice") == "all"


def _as_older_generator_wrote_it(repo: Path) -> None:
    """Rewrite a generated repository as the generator before ``version.json`` wrote it:
    version 1 described by config parameters ``version.1.*``, no ``ENCODER`` output."""
    from google.protobuf import text_format

    from services.encoder.build.repository import ENCODER_OUTPUT, VERSION_FILE

    model = repo / "embed"
    own = json.loads((model / "1" / VERSION_FILE).read_text())
    (model / "1" / VERSION_FILE).unlink()
    config = read_config(model / "config.pbtxt")
    for key, value in own.items():
        config.parameters[f"version.1.{key}"].string_value = value
    outputs = [o for o in config.output if o.name != ENCODER_OUTPUT]
    del config.output[:]
    config.output.extend(outputs)
    (model / "config.pbtxt").write_text(text_format.MessageToString(config))


def test_a_repository_of_the_older_generator_serves_and_a_publish_converts_it(
    served: Served, tmp_path: Path
) -> None:
    """Versions described in config.pbtxt (``version.<n>.*``, the generator before): the
    client reads its version's name and digest there; a publish converts the repository
    (``version.json`` per version, the ``ENCODER`` output) and both versions answer with
    the same names and digests as before, read from the model. (The version folder keeps
    this release's model code, which reads either description.)"""
    repo = tmp_path / "repo"
    generate_repository(
        ensure_onnx(default_model_dir(), served.base),
        repo,
        RepositoryConfig(instances=1, intra_op_threads=1),
    )
    digest = describe_versions(repo)[0].digest
    _as_older_generator_wrote_it(repo)
    cfg = TritonServerConfig(
        repo,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        startup_timeout_s=90,
    )
    with run_triton(cfg, tmp_path / "triton.log") as handle:
        url = handle.grpc_url
        before, _ = asyncio.run(_encode_all(url, "1"))
        assert (before.model_name, before.digest) == ("all-MiniLM-L6-v2", digest)
        spec = publish_version(repo, ensure_second_encoder(served.base), url)
        config = read_config(repo / "embed" / "config.pbtxt")
        assert not [k for k in config.parameters if k.startswith("version.")]
        assert "ENCODER" in {o.name for o in config.output}
        first, got = asyncio.run(_encode_all(url, "1"))
        assert (first.model_name, first.digest) == ("all-MiniLM-L6-v2", digest)
        want = _expected(default_model_dir())
        assert min(row_cosines(got["query"], want["query"])) >= 0.999
        second, _ = asyncio.run(_encode_all(url, str(spec.version)))
        assert (second.model_name, second.digest) == ("all-MiniLM-L6-v2-perturbed", spec.digest)


def test_a_generation_recorded_without_a_version_gets_version_one_not_the_newest(
    served: Served,
) -> None:
    """A shard records g1 from its manifest, with no Triton version (0). After a publish,
    a gateway started later pins the newest version for its own encoder; g1's searches
    must still be encoded by version 1, the store's encoder."""
    from services.gateway.server import GenerationParts, build_encoder
    from services.gateway.settings import GatewaySettings
    from services.generations.registry import EncoderSpec, Generation

    url = served.handle.grpc_url
    publish_version(served.repo, ensure_second_encoder(served.base), url)  # v2 (if not yet)
    settings = GatewaySettings(shards="127.0.0.1:1", auth=False, triton_url=url)

    async def go() -> None:
        own = await build_encoder(settings)  # the newest, pinned
        parts = GenerationParts(settings, None, 2, own)
        try:
            assert own.model_version == 2  # type: ignore[attr-defined]
            g1 = Generation("g1", "serving", 2, EncoderSpec("all-MiniLM-L6-v2", 0, 384), "")
            encoder, owned = await parts.encoder(g1)
            assert owned and encoder.model_version == 1  # type: ignore[attr-defined]
            assert encoder.model_name == "all-MiniLM-L6-v2"
            await encoder.close()
            g2 = Generation("g2", "building", 2, EncoderSpec("embed", 2, 384), "")
            assert await parts.encoder(g2) == (own, False)  # the gateway's own encoder
        finally:
            await own.close()

    asyncio.run(go())


def test_a_triton_serving_a_copy_of_the_repository_is_awaited(
    served: Served, tmp_path: Path
) -> None:
    """The chart's Triton pods serve a copy of the shared repository that a sidecar keeps
    in step: the publish's load reaches a Triton whose copy has no new version yet, and
    the publish waits until the sidecar has linked and loaded it (here the test plays the
    sidecar, after Triton's log shows the publish's load)."""
    shared = tmp_path / "shared"  # what the publish writes; the Triton serves served.repo
    shutil.copytree(served.repo, shared, ignore=shutil.ignore_patterns(".publish.lock"))
    # the third encoder (unpublished again above: its version number is reused)
    third = ensure_onnx(ensure_second_encoder(served.base, seed=3), served.base).parent
    loads = _load_count(served.handle)
    with ThreadPoolExecutor(1) as pool:
        publishing = pool.submit(publish_version, shared, third, served.handle.grpc_url)
        wait_until(
            lambda: _load_count(served.handle) > loads or publishing.done(),
            "the publish asked Triton to load embed",
            timeout=300,
        )
        assert not publishing.done(), publishing.exception()  # waiting for the version
        version = served_versions(shared)[-1]
        shutil.copytree(shared / "embed" / str(version), served.repo / "embed" / str(version))
        shutil.copy2(shared / "embed" / "config.pbtxt", served.repo / "embed" / "config.pbtxt")
        _load(served.handle)  # the sidecar's load
        spec = publishing.result(timeout=300)
    assert spec.version == version
    assert str(version) in _ready_versions(served.handle)


def _load(handle: TritonHandle) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(handle.grpc_url)
    try:
        client.load_model("embed")
    finally:
        client.close()


def test_a_server_without_the_pinned_version_is_unavailable_not_not_found(served: Served) -> None:
    """A pod that has not loaded the version yet answers NOT_FOUND; to the encoder that is
    the server being unable to serve it (Unavailable: fail over), not a caller's mistake."""
    cfg = TritonEncoderConfig(served.handle.grpc_url, model_version="9", retries=0)

    async def go() -> None:
        encoder = TritonEncoder(cfg, "nine", 384, 64)  # as pinned at a connect elsewhere
        try:
            with pytest.raises(Unavailable, match=r"version 9 is not found.*not loaded on"):
                await encoder.encode(["x"], "query", timeout=10)
        finally:
            await encoder.close()

    asyncio.run(go())


def test_unpublish_refuses_a_version_an_index_generation_uses(
    served: Served, tmp_path: Path, redis_url: str
) -> None:
    """On a real redis-server: a version that a generation not yet retired uses stays
    (FAILED_PRECONDITION naming the generation, exit 2); g1 recorded without a version
    uses version 1; a rollout still publishing its encoder keeps every version. Once the
    generation is retired and the rollout gone the version may go."""
    import redis

    from services.generations.registry import EncoderSpec, Registry

    repo = tmp_path / "repo"
    shutil.copytree(served.repo, repo, ignore=shutil.ignore_patterns(".publish.lock"))
    assert served_versions(repo)[:2] == [1, 2]
    client = redis.Redis.from_url(redis_url)
    registry = Registry(client)
    registry.ensure_first(2, EncoderSpec("all-MiniLM-L6-v2", 0, 384), "/index")  # version 1
    g2 = registry.create(2, EncoderSpec("embed", 2, 384), "/index-g2", {})
    before = _snapshot(repo)
    for version, generation in ((1, "g1"), (2, "g2")):
        run = _cli(
            "unpublish", "--repo", str(repo), "--redis-url", redis_url, "--version", str(version)
        )
        assert run.returncode == 2, run.stderr
        assert f"embed version {version} is the encoder of generation(s) {generation}" in (
            run.stderr
        )
    assert _snapshot(repo) == before
    registry.put(replace(g2, state="retired"))
    plan = json.dumps({"encoder": None, "encoder_dir": "/new"})
    registry.begin_rollout({"target": "g3", "source": "g1", "phase": "publish", "plan": plan})
    run = _cli("unpublish", "--repo", str(repo), "--redis-url", redis_url, "--version", "2")
    assert run.returncode == 2, run.stderr
    assert "generation(s) g3 (a rollout publishing its encoder)" in run.stderr, run.stderr
    assert _snapshot(repo) == before
    registry.end_rollout()
    run = _cli("unpublish", "--repo", str(repo), "--redis-url", redis_url, "--version", "2")
    assert run.returncode == 0, run.stderr
    assert 2 not in served_versions(repo)
    client.close()


def test_retire_unpublishes_its_encoder_version_only_once_no_generation_uses_it(
    served: Served, tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`index retire` through the CLI on the local stack's run dir (real redis-server, the
    module's tritonserver): a version that the serving generation, or a running rollout's
    target, still uses stays published and loaded; the retired generation's version that
    nobody uses any more leaves the repository and Triton. With Triton unreachable the
    generation is retired all the same, the version stays, and the exit status is 3 with
    a warning naming the version and the `encoder unpublish` command; `index retire`
    again, Triton back, unpublishes it."""
    import redis

    from services.cli.main import main
    from services.generations.registry import EncoderSpec, Registry
    from services.index.keys import LAYOUT_KEY

    url, repo = served.handle.grpc_url, served.repo
    shared = publish_version(repo, ensure_second_encoder(served.base), url).version
    alone = publish_version(repo, ensure_second_encoder(served.base, seed=3), url).version
    assert len({1, shared, alone}) == 3 and {"1", str(shared), str(alone)} <= set(
        _ready_versions(served.handle)
    )

    def run_dir(name: str, triton_grpc: str) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "stack.json").write_text(
            json.dumps(
                {
                    "redis_url": redis_url,
                    "triton_grpc": triton_grpc,
                    "triton_repository": str(repo),
                    "index_root": str(tmp_path / "generations"),
                }
            )
        )
        return str(folder)

    stack, down = run_dir("stack", url), run_dir("down", f"127.0.0.1:{free_port()}")
    client = redis.Redis.from_url(redis_url)
    client.hset(LAYOUT_KEY, mapping={"version": "2", "shards": "2"})
    registry = Registry(client)
    registry.ensure_first(2, EncoderSpec("all-MiniLM-L6-v2", 0, 384), "/index")  # version 1
    g2 = registry.create(2, EncoderSpec("embed", shared, 384), "/g2", {})
    registry.put(replace(g2, state="previous"))  # the rollback target
    registry.create(2, EncoderSpec("embed", shared, 384), "/g3", {})  # a rollout's target
    registry.begin_rollout({"target": "g3", "source": "g1", "kind": "rollout", "phase": "bulk"})
    g4 = registry.create(2, EncoderSpec("embed", alone, 384), "/g4", {})
    registry.put(replace(g4, state="failed"))  # an aborted rollout's target
    g5 = registry.create(2, EncoderSpec("embed", 1, 384), "/g5", {})
    registry.put(replace(g5, state="previous"))  # displaced from the rollback target

    def retire(generation: str, where: str) -> tuple[int, str, str]:
        status = main(["index", "retire", "--generation", generation, "--yes", "--run-dir", where])
        out = capsys.readouterr()
        return status, out.out, out.err

    # still used: by a running rollout's target (g3), by the serving generation (g1)
    before = _snapshot(repo)
    for generation, version, user in (("g2", shared, "g3"), ("g5", 1, "g1")):
        status, out, err = retire(generation, stack)
        assert status == 0, err
        assert registry.get(generation).state == "retired"
        assert f"embed version {version} stays published: the encoder of {user}" in out
    assert _snapshot(repo) == before
    assert {"1", str(shared), str(alone)} <= set(_ready_versions(served.handle))

    # nobody uses g4's version, but Triton cannot be asked: retired, the version kept
    status, _, err = retire("g4", down)
    assert status == 3, err
    assert registry.get("g4").state == "retired"
    assert f"g4 is retired, but embed version {alone}, its encoder, is still published" in err
    assert f"gtr-retrieval encoder unpublish --version {alone} --repo {repo}" in err
    assert _snapshot(repo) == before
    assert str(alone) in _ready_versions(served.handle)

    # again with Triton there: out of the repository and out of Triton
    status, out, err = retire("g4", stack)
    assert status == 0, err
    assert f"embed version {alone} (no other generation uses it) unpublished" in out
    assert alone not in served_versions(repo) and shared in served_versions(repo)
    ready = _ready_versions(served.handle)
    assert str(alone) not in ready and {"1", str(shared)} <= set(ready)
    client.close()


def test_a_rollout_refused_at_the_lock_leaves_no_encoder_version_behind(
    served: Served, tmp_path: Path, redis_url: str
) -> None:
    """Two operators start `index rollout --encoder` at once: the one whose builder finds
    the rollout lock taken (here: taken while its `Go ahead?` waits on a terminal, after
    it read the registry) is refused, naming the running rollout, with exit status 2, and
    has published nothing: the lock comes before the publish (it used to publish first and
    unpublish again), so `encoder versions` lists what it listed before."""
    import pty
    import select
    import socket
    import time

    import redis

    from services.generations.registry import EncoderSpec, Registry
    from services.index.keys import LAYOUT_KEY
    from tests.support.processes import wait_until

    url, repo = served.handle.grpc_url, served.repo
    fresh = ensure_second_encoder(served.base, seed=5)  # published by no other test
    run_dir = tmp_path / "stack"
    run_dir.mkdir()
    (run_dir / "stack.json").write_text(
        json.dumps(
            {
                "redis_url": redis_url,
                "triton_grpc": url,
                "triton_repository": str(repo),
                "index_root": str(tmp_path / "generations"),
            }
        )
    )
    client = redis.Redis.from_url(redis_url)
    client.hset(LAYOUT_KEY, mapping={"version": "2", "shards": "2"})
    registry = Registry(client)
    registry.ensure_first(2, EncoderSpec("embed", 1, 384), "/index")
    listed = _cli("versions", "--repo", str(repo), "--json")
    assert listed.returncode == 0, listed.stderr
    versions, ready = served_versions(repo), _ready_versions(served.handle)

    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "index",
            "rollout",
            "--encoder",
            str(fresh),
            "--run-dir",
            str(run_dir),
            "--quiet",
        ],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        close_fds=True,
    )
    os.close(follower)
    said = bytearray()

    def read() -> str:
        while select.select([leader], [], [], 0)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the process closed its side
                break
            if not chunk:
                break
            said.extend(chunk)
        return said.decode(errors="replace")

    try:
        wait_until(lambda: "Go ahead? [y/N]" in read(), "the rollout's question", 120)
        # the other operator's rollout takes the lock meanwhile (its builder: this process)
        registry.begin_rollout(
            {
                "target": "g7",
                "source": "g1",
                "kind": "rollout",
                "mode": "encode",
                "phase": "bulk",
                "host": socket.gethostname(),
                "pid": str(os.getpid()),
                "beat": repr(time.time()),
                "owner": "the other operator",
                "plan": json.dumps(
                    {
                        "encoder": EncoderSpec("embed", 1, 384).__dict__,
                        "shards": 2,
                        "retrain": False,
                    }
                ),
            }
        )
        os.write(leader, b"y\n")
        # read while it runs: a full terminal buffer would block its writes
        wait_until(lambda: read() is None or process.poll() is not None, "its exit", 300)
        out = read()
        assert process.returncode == 2, out
        assert "a rollout to g7 is running" in out, out
        assert "publishing" not in out and "published as" not in out, out
        assert served_versions(repo) == versions
        assert _ready_versions(served.handle) == ready
        again = _cli("versions", "--repo", str(repo), "--json")
        assert again.returncode == 0 and again.stdout == listed.stdout, again.stderr
        assert _recorded(registry).target == "g7"  # the other one's, intact
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(leader)
        registry.end_rollout()
        client.close()


@contextlib.contextmanager
def _publish_lock(repo: Path) -> Iterator[None]:
    """Hold the repository's publish lock (``embed/.publish.lock``, the ``flock`` every
    publish and unpublish takes): theirs wait until the block ends."""
    with (repo / "embed" / ".publish.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _waits_for_a_lock(pid: int) -> bool:
    """Whether process ``pid`` is blocked on a file lock (``/proc/locks``: a waiter's line
    has ``->`` before the lock's type, then class, mode and the waiting pid)."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        at = fields.index("->") if "->" in fields else -1
        if at >= 0 and fields[at + 4 : at + 5] == [str(pid)]:
            return True
    return False


def _generation_stack(tmp_path: Path, redis_url: str, served: Served) -> tuple[Path, Any]:
    """A run dir naming the module's Triton and repository and a fresh store whose g1
    (2 shards, version 1) serves; → (run dir, blocking Redis client)."""
    import redis

    from services.generations.registry import EncoderSpec, Registry
    from services.index.keys import LAYOUT_KEY

    run_dir = tmp_path / "stack"
    run_dir.mkdir()
    (run_dir / "stack.json").write_text(
        json.dumps(
            {
                "redis_url": redis_url,
                "triton_grpc": served.handle.grpc_url,
                "triton_repository": str(served.repo),
                "index_root": str(tmp_path / "generations"),
            }
        )
    )
    client = redis.Redis.from_url(redis_url)
    client.hset(LAYOUT_KEY, mapping={"version": "2", "shards": "2"})
    Registry(client).ensure_first(2, EncoderSpec("embed", 1, 384), "/index")
    return run_dir, client


def _index(*args: str, **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "index", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def _finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = process.communicate(timeout=300)
    return process.returncode, out


def test_a_retire_during_a_rollouts_publish_keeps_the_version_it_publishes(
    served: Served, tmp_path: Path, redis_url: str
) -> None:
    """The race of a retire with `index rollout --encoder` whose export is the retired
    generation's version (the publish returns the version already there): the retire's
    first check finds nobody using it and its unpublish waits for the repository's lock
    (held here); the rollout records its lock, phase `publish`, before its publish takes
    that lock. Whichever gets the repository first, the version stays: the retire asks
    again under the lock and sees the rollout publishing, and the rollout records the
    version it got. (The rollout used to publish before taking the rollout lock: it was
    never seen in phase `publish`, and a retire in between unpublished its version.)"""
    from services.generations.registry import EncoderSpec, Registry

    url, repo = served.handle.grpc_url, served.repo
    export = ensure_onnx(ensure_second_encoder(served.base, seed=5), served.base).parent
    version = publish_version(repo, export, url).version
    run_dir, client = _generation_stack(tmp_path, redis_url, served)
    registry = Registry(client)
    g2 = registry.create(2, EncoderSpec("embed", version, 384), "/g2", {})
    registry.put(replace(g2, state="previous"))
    retire = rollout = None
    try:
        with _publish_lock(repo):
            retire = _index("retire", "--generation", "g2", "--yes", "--run-dir", str(run_dir))
            wait_until(
                lambda: _waits_for_a_lock(retire.pid) or retire.poll() is not None,
                "the retire waiting to unpublish",
                120,
            )
            assert retire.poll() is None, _finish(retire)
            rollout = _index(
                "rollout", "--encoder", str(export), "--run-dir", str(run_dir), "--yes", "--quiet"
            )
            wait_until(
                lambda: _recorded(registry).phase == "publish" or rollout.poll() is not None,
                "the rollout's lock, taken before its publish",
                120,
            )
            assert rollout.poll() is None, _finish(rollout)
        status, out = _finish(retire)
        assert status == 0, out
        assert f"embed version {version} stays published: the encoder of g3" in out, out
        assert registry.get("g2").state == "retired"
        wait_until(
            lambda: _recorded(registry).phase != "publish" or rollout.poll() is not None,
            "the rollout past its publish",
            300,
        )
        plan = _recorded(registry).plan
        planned = plan.encoder if plan is not None else None
        assert planned is not None and planned.version == version, _finish(rollout)
        assert registry.get("g3").encoder.version == version
        assert version in served_versions(repo)
        assert str(version) in _ready_versions(served.handle)
    finally:
        for process in (retire, rollout):
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                process.communicate()
        registry.end_rollout()
        client.close()
        with contextlib.suppress(NotFound, FailedPrecondition):  # as the module had it
            unpublish_version(repo, version, url)


def test_a_rollout_killed_while_publishing_is_aborted_or_resumed_cleanly(
    served: Served, tmp_path: Path, redis_url: str
) -> None:
    """`index rollout --encoder` killed (-9) in its publish phase, before the publish got
    the repository: `--abort` ends it with nothing recorded and nothing published; killed
    so again, `index rollout` with no options resumes it: it publishes the folder its plan
    names, records the version and its target, and goes on (here to the train phase, which
    an empty store refuses); `--abort` then leaves the target `failed`. The scratch folders
    the killed publishes could not remove are removed by the publish that resumes."""
    from services.encoder.serve.publish import SCRATCH_PREFIX
    from services.generations.registry import Registry

    url, repo = served.handle.grpc_url, served.repo
    export = ensure_onnx(ensure_second_encoder(served.base, seed=5), served.base).parent
    run_dir, client = _generation_stack(tmp_path, redis_url, served)
    registry = Registry(client)
    where = ("--run-dir", str(run_dir))
    versions = served_versions(repo)
    killed: list[int] = []

    def scratch(pid: int) -> list[Path]:
        return list(Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}{pid}-*"))

    def killed_while_publishing() -> str:
        with _publish_lock(repo):
            process = _index("rollout", "--encoder", str(export), *where, "--yes", "--quiet")
            try:
                wait_until(
                    lambda: _waits_for_a_lock(process.pid) or process.poll() is not None,
                    "the rollout waiting to publish",
                    120,
                )
                assert process.poll() is None, _finish(process)
                running = _recorded(registry)
                assert running.phase == "publish", running
            finally:
                process.kill()
                process.communicate()
        killed.append(process.pid)
        assert scratch(process.pid), "a publish killed -9 leaves its scratch folder"
        assert served_versions(repo) == versions
        with pytest.raises(NotFound):
            registry.get(running.target)
        return running.target

    target = killed_while_publishing()
    status, out = _finish(_index("rollout", "--abort", *where))
    assert status == 0, out
    assert f"aborted the rollout to {target} (phase publish)" in out, out
    assert registry.running() is None
    assert served_versions(repo) == versions

    target = killed_while_publishing()
    status, out = _finish(_index("rollout", *where, "--yes", "--quiet"))
    assert status == 2, out  # the train phase: an empty store has nothing to train on
    assert "nothing to train on" in out, out
    running = _recorded(registry)
    assert running.phase == "train" and running.plan is not None, running
    assert running.plan.encoder is not None, running
    version = running.plan.encoder.version
    assert f"published as embed version {version}" in out, out
    assert not [path for pid in killed for path in scratch(pid)]  # the resumed publish's work
    assert registry.get(target).encoder.version == version
    assert version in served_versions(repo) and str(version) in _ready_versions(served.handle)
    try:
        status, out = _finish(_index("rollout", "--abort", *where))
        assert status == 0, out
        assert registry.get(target).state == "failed" and registry.running() is None
    finally:
        registry.end_rollout()
        client.close()
        with contextlib.suppress(NotFound, FailedPrecondition):
            unpublish_version(repo, version, url)


def _stub_of(handle: TritonHandle, version: int) -> int:
    """The pid of Triton's Python backend stub serving ``embed`` version ``version``."""
    for pid in _stubs(handle, Path(handle.config.model_repository), version):
        return pid
    raise AssertionError(f"no backend stub of embed version {version} runs")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a CPU budget needs two CPUs")
def test_a_version_published_with_a_cpu_budget_runs_its_stub_there(served: Served) -> None:
    """`index rollout --cpus`: the new version's stub pins every thread of itself to the
    budget before it loads (its ONNX Runtime threads inherit it), answers from there, and
    the budget file goes when the rollout ends (a later load may use every CPU)."""
    from services.process.cpus import BUDGET_FILE, budget_path

    cpu = max(os.sched_getaffinity(0))
    fourth = ensure_onnx(ensure_second_encoder(served.base, seed=4), served.base).parent
    url = served.handle.grpc_url
    spec = publish_version(served.repo, fourth, url, cpus=frozenset({cpu}))
    try:
        budget = Path(budget_path(str(served.repo / "embed" / str(spec.version))))
        assert budget.read_text() == str(cpu)  # beside the model folders, not in its folder
        assert budget.parent == served.repo and not list(served.repo.rglob(BUDGET_FILE))
        stub = _stub_of(served.handle, spec.version)
        tasks = os.listdir(f"/proc/{stub}/task")
        assert len(tasks) > 1
        assert {frozenset(os.sched_getaffinity(int(t))) for t in tasks} == {frozenset({cpu})}
        other = _stub_of(served.handle, 1)  # the serving version's stub is left alone
        assert os.sched_getaffinity(other) == os.sched_getaffinity(0)
        _, got = asyncio.run(_encode_all(url, str(spec.version)))
        assert got["query"].shape == (len(SAMPLE_QUERIES), 384)
        clear_cpu_budgets(served.repo)
        assert not budget.exists()
        # the rollout has ended: the next load (a later publish) reloads no version, this
        # one included (its budget file was not in its folder)
        stubs = {v: _stubs(served.handle, served.repo, v) for v in (1, spec.version)}
        load_model(url, None, None)
        assert {v: _stubs(served.handle, served.repo, v) for v in (1, spec.version)} == stubs
    finally:
        unpublish_version(served.repo, spec.version, url)
