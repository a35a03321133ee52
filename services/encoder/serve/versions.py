"""Several encoder versions in one Triton repository: the repository's side (issue #24).

An index rollout to a new encoder (docs/generations.md) needs the new encoder served
*beside* the one the serving generation uses: the old one keeps answering searches while
the stored documents are re-embedded with the new one, and either may serve after the
switch (rollback). Both are versions of the one model ``embed``: the CPU flavour's config
has ``version_policy: all``, and each version folder ``embed/<n>/`` holds its own ONNX
graph(s), tokenizer, ``encoder.json``, copy of the model code and ``version.json`` (source
model, dim, profile, digest, graph files), which the model overlays on the shared
parameters and answers on its ``ENCODER`` output to the client (``TritonEncoder.connect``).

The work is split by responsibility:

- this module: the repository's versions as they are (:func:`served_versions`,
  :func:`describe_versions`, :func:`spec_of`), the publish lock (one publish or unpublish
  at a time per model folder, ``embed/.publish.lock``), atomic writes, the staging a
  killed publish left, the conversion of an older generator's repository, and the
  rollout's CPU budget files;
- :mod:`services.encoder.serve.publish`: :func:`~services.encoder.serve.publish.publish_version`
  (``encoder publish``, ``index rollout --encoder``);
- :mod:`services.encoder.serve.unpublish`:
  :func:`~services.encoder.serve.unpublish.unpublish_version` (``encoder unpublish``,
  ``index retire``);
- :mod:`services.encoder.serve.triton_load`: making running Tritons load ``embed`` again
  and waiting for a version to be ready there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.encoder_spec import EncoderSpec
from services.common.errors import FailedPrecondition
from services.encoder.build.repository import (
    EMBED_MODEL,
    ENCODER_OUTPUT,
    MODELS_DIR,
    PUBLISH_LOCK,
    VERSION_FILE,
    legacy_version_parameters,
    model_code,
    read_config,
    read_version_description,
    write_version_file,
)
from services.process.cpus import BUDGET_FILE, budget_path

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2 as mc


def served_versions(repo_dir: Path, model: str = EMBED_MODEL) -> list[int]:
    """The version folders of ``model`` in the repository, ascending."""
    root = Path(repo_dir) / model
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def spec_of(model_dir: Path, config: mc.ModelConfig, version: int, source: str = "") -> EncoderSpec:
    """The :class:`EncoderSpec` of one version, as its ``version.json`` (or an older
    repository's config parameters) describes it."""
    own = read_version_description(model_dir, config, version)
    widths = {o.name: list(o.dims) for o in config.output}.get("EMBEDDING", [0])
    dim = int(own.get("dim") or widths[-1])
    return EncoderSpec(config.name, version, dim, own.get("digest", ""), source)


def describe_versions(repo_dir: Path) -> list[EncoderSpec]:
    """Every version of ``embed`` in the repository, as its config describes it."""
    repo = Path(repo_dir)
    config_path = repo / EMBED_MODEL / "config.pbtxt"
    if not config_path.exists():
        raise FailedPrecondition(f"{repo} has no {EMBED_MODEL} model")
    config = read_config(config_path)
    return [spec_of(repo / EMBED_MODEL, config, version) for version in served_versions(repo)]


def convert_older(model_path: Path, config: mc.ModelConfig) -> str | None:
    """Convert a repository of an older generator in place: each version's
    ``version.<n>.*`` parameters into its ``version.json`` (with this model code), and a
    config without them, with the ``ENCODER`` output and ``version_policy: all``; also
    finishes an unpublish that stopped before its folder went (a version folder that
    ``version_policy: specific`` leaves out). Returns the new config text, or None when
    there was nothing to convert. Triton reloads every version at the next load."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    changed = False
    policy = config.version_policy
    if policy.WhichOneof("policy_choice") == "specific":
        kept = set(policy.specific.versions)
        for version in served_versions(model_path.parent, model_path.name):
            if version not in kept:
                shutil.rmtree(model_path / str(version))
    if policy.WhichOneof("policy_choice") != "all":
        policy.all.SetInParent()
        changed = True
    for version in served_versions(model_path.parent, model_path.name):
        folder = model_path / str(version)
        if legacy_version_parameters(config, version) or not (folder / VERSION_FILE).exists():
            own = read_version_description(model_path, config, version)
            keys = ("source_model", "dim", "profile", "digest", "onnx_file", "document_onnx_file")
            write_version_file(folder, {k: own.get(k, "") for k in keys})
            model_code_into(folder)
            changed = True
    for key in [k for k in config.parameters if k.startswith("version.")]:
        del config.parameters[key]
        changed = True
    if ENCODER_OUTPUT not in {o.name for o in config.output}:
        config.output.add(name=ENCODER_OUTPUT, data_type=model_config_pb2.TYPE_STRING, dims=[1])
        changed = True
    return text_format.MessageToString(config) if changed else None


@contextlib.contextmanager
def locked(model_dir: Path) -> Iterator[None]:
    """One publish at a time per model folder (an exclusive ``flock`` on the lock file
    ``encoder repo`` wrote; opening it to lock changes no time Triton looks at)."""
    with (model_dir / PUBLISH_LOCK).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def model_code_into(folder: Path) -> None:
    model_code(folder, MODELS_DIR / "embed_onnx.py")


def write_budget(version_dir: Path, cpus: frozenset[int]) -> None:
    """The CPU budget of the version at ``version_dir``, beside the model folders
    (:func:`~services.process.cpus.budget_path`), written before the version loads."""
    write_atomically(Path(budget_path(str(version_dir))), ",".join(map(str, sorted(cpus))))


def clear_cpu_budgets(repo_dir: Path) -> None:
    """Remove every version's CPU budget file (the rollout that wrote it has ended; a
    stub loaded from now on may use every CPU). No version folder is touched (see
    :func:`~services.process.cpus.budget_path`), except an older release's budget file
    inside one."""
    for path in Path(repo_dir).glob(f".{EMBED_MODEL}.*.{BUDGET_FILE}"):
        path.unlink(missing_ok=True)
    for path in (Path(repo_dir) / EMBED_MODEL).glob(f"*/{BUDGET_FILE}"):
        path.unlink(missing_ok=True)


def drop_stale_staging(model_path: Path) -> None:
    """Remove what a killed publish left in the model folder (under the publish lock: no
    publish is running). Left there, a ``.staging-<n>`` folder, a non-version entry newer
    than the versions' load, makes Triton reload every version at the next load. The
    staging stays inside the model folder: on the repository's root, a Triton started
    meanwhile (``--load-model=*``) takes the folder for a model, fails to load it and
    exits ("failed to load all models"; tried with this wheel's tritonserver)."""
    for stale in model_path.glob(".staging-*"):
        shutil.rmtree(stale, ignore_errors=True)
