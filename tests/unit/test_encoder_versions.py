"""What ``encoder publish`` refuses before touching a repository, and the per-version
parameters (issue #24). No Triton here: tests/integration/test_triton_versions.py serves
the versions on a real one. The configs are the generator's own (``cpu_embed_config``,
``gpu_configs``), the tokenizer MiniLM's real ``tokenizer.json``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.encoder.base import version_key
from services.encoder.build.export import EncoderMeta
from services.encoder.build.repository import (
    RepositoryConfig,
    cpu_embed_config,
    gpu_configs,
    version_description,
)
from services.encoder.model import default_model_dir
from services.encoder.profiles import get_profile
from services.encoder.runtime.triton_client import describe_version, version_params
from services.encoder.serve.publish import (
    SCRATCH_PREFIX,
    Export,
    drop_dead_scratch,
    servable_problem,
)
from services.process.cpus import running
from tests.support.processes import wait_until

MINILM = EncoderMeta(
    model_name="all-MiniLM-L6-v2",
    dim=384,
    profile="minilm",
    max_lens={"query": 64, "document": 256},
    pad_id=0,
    source_dir="/nowhere",
)


def _export(tmp_path: Path, meta: EncoderMeta, tokenizer: str | None = None) -> Export:
    folder = tmp_path / "export"
    folder.mkdir()
    if tokenizer is None:
        shutil.copy2(default_model_dir() / "tokenizer.json", folder / "tokenizer.json")
    else:
        (folder / "tokenizer.json").write_text(tokenizer)
    return Export(folder / "model.onnx", meta, "d1g3st")


def _cpu_config(meta: EncoderMeta = MINILM):  # type: ignore[no-untyped-def]
    return cpu_embed_config(meta, get_profile("minilm"), RepositoryConfig())


def test_an_encoder_of_the_same_width_and_a_fast_tokenizer_is_servable(tmp_path: Path) -> None:
    other = EncoderMeta(**{**MINILM.__dict__, "model_name": "retrained", "pad_id": 3})
    assert servable_problem(_cpu_config(), _export(tmp_path, other), tmp_path) is None


def test_another_width_is_refused_saying_what_it_needs(tmp_path: Path) -> None:
    wide = EncoderMeta(**{**MINILM.__dict__, "model_name": "gtr-t5-base", "dim": 768})
    problem = servable_problem(_cpu_config(), _export(tmp_path, wide), tmp_path)
    assert problem is not None
    assert "768 dimensions" in problem and "EMBEDDING [384]" in problem
    assert "needs a Triton model of its own" in problem


@pytest.mark.parametrize(
    ("change", "tokenizer", "said"),
    [
        ({"max_lens": {"query": 64}}, None, "token budgets for ['query']"),
        ({}, "{not a tokenizer", "cannot be read by the `tokenizers` library"),
        ({"pad_id": 10**6}, None, "pad id 1000000 is outside its tokenizer's vocabulary"),
    ],
)
def test_a_tokenizer_the_model_cannot_run_is_refused(
    tmp_path: Path, change: dict[str, object], tokenizer: str | None, said: str
) -> None:
    meta = EncoderMeta(**{**MINILM.__dict__, **change})  # type: ignore[arg-type]
    problem = servable_problem(_cpu_config(), _export(tmp_path, meta, tokenizer), tmp_path)
    assert problem is not None and said in problem


def test_the_gpu_flavour_is_refused(tmp_path: Path) -> None:
    config = gpu_configs(MINILM, get_profile("minilm"), RepositoryConfig(flavor="gpu"))["embed"]
    problem = servable_problem(config, _export(tmp_path, MINILM), tmp_path)
    assert problem is not None and "gpu flavour" in problem


def _legacy_parameters(version: int, meta: EncoderMeta, digest: str) -> dict[str, str]:
    """The ``version.<n>.*`` config parameters an older generator wrote for a version."""
    return {version_key(version, k): v for k, v in version_description(meta, digest).items()}


def test_each_version_reads_its_own_parameters_over_the_shared_ones() -> None:
    """A repository of an older generator (versions described in config.pbtxt) still
    serves: the client reads each version's parameters over the shared ones."""
    config = _cpu_config()
    for key, value in {
        **_legacy_parameters(1, MINILM, "aaaa"),
        **_legacy_parameters(2, EncoderMeta(**{**MINILM.__dict__, "model_name": "second"}), "bbbb"),
    }.items():
        config.parameters[key].string_value = value
    first, second = describe_version(config, 1, "embed"), describe_version(config, 2, "embed")
    assert (first.source_model, first.digest) == ("all-MiniLM-L6-v2", "aaaa")
    assert (second.source_model, second.digest, second.dim) == ("second", "bbbb", 384)
    params = {k: v.string_value for k, v in config.parameters.items()}
    seen = version_params(params, 2)
    assert seen["onnx_file"] == "model.onnx" and seen["document_onnx_file"] == ""
    assert seen["intra_op_threads"] == params["intra_op_threads"]  # shared ones stay
    assert not [k for k in seen if k.startswith("version.")]
    # a repository from before versions: the shared parameters, no digest
    old = _cpu_config()
    assert describe_version(old, 1, "embed").digest == ""
    assert describe_version(old, 1, "embed").source_model == "all-MiniLM-L6-v2"


def test_the_model_and_the_client_overlay_a_versions_parameters_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rule is written twice (a model file cannot import the service): the model's
    copy, imported with Triton's real ``triton_python_backend_utils`` from the wheel,
    gives what the client's gives."""
    import importlib

    from services.encoder.build.repository import MODELS_DIR
    from services.encoder.serve.triton_server import pytriton_root

    monkeypatch.syspath_prepend(str(pytriton_root() / "backends" / "python"))
    monkeypatch.syspath_prepend(str(MODELS_DIR))
    model_errors = importlib.import_module("model_errors")
    params = {
        "onnx_file": "model.onnx",
        "dim": "384",
        "version.2.onnx_file": "v2.onnx",
        "version.2.document_onnx_file": "",
        "version.12.onnx_file": "v12.onnx",
    }
    for version in (1, 2, 12):
        assert model_errors.version_params(params, str(version)) == version_params(params, version)


def test_a_recorded_rollouts_target_uses_the_version_its_plan_names() -> None:
    """The builder takes the rollout lock (its plan naming the encoder) before it writes
    the target's record: in between, the target counts by its plan."""
    from services.generations.encoders import generations_using
    from services.generations.registry import EncoderSpec, Generation
    from services.generations.state import RecordedPlan, RolloutState

    g1 = Generation("g1", "serving", 2, EncoderSpec("all-MiniLM-L6-v2", 0, 384), "")
    g2 = Generation("g2", "retired", 2, EncoderSpec("embed", 2, 384), "")
    plan = RolloutState(target="g3", plan=RecordedPlan(EncoderSpec("embed", 2)))
    assert generations_using([g1, g2], 1) == ["g1"]  # no version recorded: version 1
    assert generations_using([g1, g2], 2) == []  # a retired generation uses nothing
    assert generations_using([g1, g2], 2, plan) == ["g3"]
    assert generations_using([g1, g2], 2, RolloutState(target="g3", phase="create")) == []
    g3 = Generation("g3", "building", 2, EncoderSpec("embed", 2, 384), "")
    assert generations_using([g1, g2, g3], 2, plan) == ["g3"]  # named once


def test_a_rollout_publishing_its_encoder_uses_every_version() -> None:
    """`index rollout --encoder` takes the lock (phase publish, its plan naming no version
    yet) before it publishes; the publish may return a version published before (the same
    export), so until the version is recorded the rollout keeps every version."""
    from services.generations.encoders import generations_using
    from services.generations.registry import EncoderSpec, Generation
    from services.generations.state import RecordedPlan, RolloutState

    g1 = Generation("g1", "serving", 2, EncoderSpec("embed", 1, 384), "")
    g2 = Generation("g2", "retired", 2, EncoderSpec("embed", 2, 384), "")
    publishing = RolloutState(
        target="g3", phase="publish", plan=RecordedPlan(None, encoder_dir="/new")
    )
    using = "g3 (a rollout publishing its encoder)"
    assert generations_using([g1, g2], 2, publishing) == [using]
    assert generations_using([g1, g2], 1, publishing) == ["g1", using]
    assert generations_using([g1, g2], 2, publishing.with_(phase="create")) == []


def test_an_older_repository_is_converted_by_publish_and_a_publish_leaves_the_config(
    tmp_path: Path,
) -> None:
    """What publish writes: a version folder with its ``version.json``, the config as it
    was (Triton reloads every loaded version when the config changes). A repository whose
    versions are described by ``version.<n>.*`` config parameters (the generator before)
    is converted once: each version's ``version.json``, a config without them."""
    from google.protobuf import text_format

    from services.encoder.build.repository import ENCODER_OUTPUT, VERSION_FILE, read_config
    from services.encoder.serve.versions import convert_older, describe_versions

    model = tmp_path / "embed"
    config = _cpu_config()
    del config.output[-1]  # the older generator had no ENCODER output
    second = EncoderMeta(**{**MINILM.__dict__, "model_name": "second"})
    for key, value in {
        **_legacy_parameters(1, MINILM, "aaaa"),
        **_legacy_parameters(2, second, "bbbb"),
    }.items():
        config.parameters[key].string_value = value
    for version in (1, 2):
        (model / str(version)).mkdir(parents=True)
    (model / "config.pbtxt").write_text(text_format.MessageToString(config))
    before = [(s.version, s.dim, s.digest) for s in describe_versions(tmp_path)]
    assert before == [(1, 384, "aaaa"), (2, 384, "bbbb")]

    converted = convert_older(model, read_config(model / "config.pbtxt"))
    assert converted is not None
    (model / "config.pbtxt").write_text(converted)
    new = read_config(model / "config.pbtxt")
    assert not [k for k in new.parameters if k.startswith("version.")]
    assert ENCODER_OUTPUT in {o.name for o in new.output}
    assert [(s.version, s.dim, s.digest) for s in describe_versions(tmp_path)] == before
    import json

    own = json.loads((model / "2" / VERSION_FILE).read_text())
    assert (own["source_model"], own["digest"], own["onnx_file"]) == (
        "second",
        "bbbb",
        "model.onnx",
    )
    assert (model / "2" / "model.py").exists()  # the model code that reads version.json
    assert convert_older(model, new) is None  # converted once: the next publish changes nothing


def test_an_unpublish_stopped_before_its_folder_went_is_finished_by_the_next_publish(
    tmp_path: Path,
) -> None:
    """Unpublish takes a version out through ``version_policy: specific`` before its
    folder goes (a folder moved aside inside the model folder would make Triton reload
    the others); a folder that policy leaves out is that unpublish, stopped."""

    from services.encoder.build.repository import VERSION_FILE, write_version_file
    from services.encoder.serve.versions import convert_older, served_versions

    model = tmp_path / "embed"
    for version in (1, 2):
        (model / str(version)).mkdir(parents=True)
        write_version_file(model / str(version), version_description(MINILM, f"d{version}"))
    config = _cpu_config()
    config.version_policy.specific.versions[:] = [1]
    converted = convert_older(model, config)
    assert converted is not None and "all {" in converted
    assert served_versions(tmp_path) == [1]
    assert (model / "1" / VERSION_FILE).exists()


@pytest.mark.parametrize("content", ['{"digest": "aaaa", cut short', '["not", "an object"]'])
def test_a_version_json_that_is_not_a_publishs_is_a_failed_precondition_naming_it(
    tmp_path: Path, content: str
) -> None:
    """``encoder versions`` / ``publish`` read each version's ``version.json``: one edited
    by hand or cut short is FAILED_PRECONDITION naming the file, not a JSON traceback."""
    from services.common.errors import FailedPrecondition
    from services.encoder.build.repository import VERSION_FILE, read_version_description

    path = tmp_path / "embed" / "1" / VERSION_FILE
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(FailedPrecondition, match=str(path)):
        read_version_description(tmp_path / "embed", _cpu_config(), 1)


def test_an_encoders_identity_reads_version_0_as_1_and_tells_other_weights_apart() -> None:
    from services.common.encoder_spec import EncoderSpec

    first = EncoderSpec("embed", 1, 384, "abc")
    assert EncoderSpec("embed", 0, 384, "abc").identity() == first.identity()
    for other in (
        EncoderSpec("embed", 2, 384, "abc"),
        EncoderSpec("embed", 1, 384, "def"),
        EncoderSpec("embed", 1, 768, "abc"),
    ):
        assert other.identity() != first.identity()
    # the same weights, exported from another folder: the same version serves them
    assert EncoderSpec("embed", 1, 384, "abc", "/checkpoints/other").identity() == (
        EncoderSpec("embed", 1, 384, "abc", "/checkpoints/first").identity()
    )
    # without a digest (an in-process encoder) the folder is all that tells them apart
    assert EncoderSpec("m", 0, 384, "", "/a").identity() != (
        EncoderSpec("m", 0, 384, "", "/b").identity()
    )
    assert EncoderSpec("m", 0, 384, "", "/a").identity() != (
        EncoderSpec("m", 0, 384, "/a").identity()  # a digest that reads like a folder
    )


def test_the_scratch_of_a_killed_publish_is_removed_by_the_next(tmp_path: Path) -> None:
    """A publish killed (-9) cannot remove its scratch folder; the next one removes those
    whose process is gone, and leaves a live publish's and folders not named for a pid."""
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = tmp_path / f"{SCRATCH_PREFIX}{int(ended.stdout)}-k3x"
    live = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-a1b"
    older = tmp_path / f"{SCRATCH_PREFIX}vwxvo108"  # named before the pid was in the name
    # killed and not yet reaped by its parent: a zombie has ended too
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    zombie = tmp_path / f"{SCRATCH_PREFIX}{killed.pid}-z0m"
    for folder in (dead, live, older, zombie):
        folder.mkdir()
    (dead / "model.onnx").write_bytes(b"half an export")
    try:
        wait_until(lambda: not running(killed.pid), "the killed child is a zombie", 10)
        assert sorted(drop_dead_scratch(tmp_path)) == sorted([dead, zombie])
    finally:
        killed.wait()
    assert not dead.exists() and not zombie.exists() and live.is_dir() and older.is_dir()
