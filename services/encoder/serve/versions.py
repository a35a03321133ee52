"""Several encoder versions in one Triton repository: ``encoder publish`` (issue #24).

An index rollout to a new encoder (docs/generations.md) needs the new encoder served
*beside* the one the serving generation uses: the old one keeps answering searches while
the stored documents are re-embedded with the new one, and either may serve after the
switch (rollback). Both are versions of the one model ``embed``: the CPU flavour's config
has ``version_policy: all``, and each version folder ``embed/<n>/`` holds its own ONNX
graph(s), tokenizer, ``encoder.json``, copy of the model code and ``version.json`` (source
model, dim, profile, digest, graph files), which the model overlays on the shared
parameters and answers on its ``ENCODER`` output to the client (``TritonEncoder.connect``).

:func:`publish_version` exports a checkpoint (the parity check gates it, as ``encoder
export``), refuses one the model cannot serve (FailedPrecondition saying what would be
needed; nothing in the repository changes), adds it as version N+1 and makes a running
Triton load it without a restart.

**Loading: explicit model control.** Triton runs with ``--model-control-mode=explicit
--load-model=*`` (``services/encoder/serve/triton_server.py``; the local stack and the
chart start it so): at start it loads every model as before, and afterwards only a
``RepositoryModelLoad`` call changes what it serves. Publishing writes the version folder
(``config.pbtxt`` is not touched), then asks each Triton named by ``triton_url`` to load
``embed`` again; Triton loads the new version and leaves the loaded ones as they are:
it reloads a loaded version only when the config changed beyond ``instance_group`` and
``version_policy`` or when the version's folder, or a non-version entry of the model
folder, is newer than at its load (triton-inference-server/core ``ModelLifeCycle::
AsyncLoad``: ``ModelTimestamp::IsModelVersionModified``, ``ConfigChangeRequiresReload``).
Hence nothing here writes into the model folder or a loaded version's folder around a
load: the lock file exists from ``encoder repo`` on, a new version is staged under a
dotted name and renamed into place before the load, an unpublish takes the version out
through ``version_policy`` (ignored by that comparison) before its folder goes, and
:func:`clear_cpu_budgets` puts a folder's time back. A repository of an older generator
(``version.<n>.*`` config parameters) is converted by the next publish, which is then
the one load that reloads every version. Polling (``--model-control-mode=poll``) was not
chosen: Triton would pick up a version folder or config half written, at a moment nobody
chose, and a publish could not tell its caller whether the new version loads. A load
that fails (Triton down, or the new version does not initialise) puts the repository
back as it was and is an error: a publish is all or nothing. A Triton started later
loads every version at start.

:func:`unpublish_version` takes a version out again (an encoder no generation uses any
more: its memory in Triton is freed); the last one stays. ``index retire`` calls it for
the retired generation's version once no generation uses it
(:func:`services.generations.encoders.generations_using`, the policy) (``encoder
unpublish`` is the same call by hand), asked under the repository's publish lock
(``in_use``): ``index rollout --encoder`` takes the rollout lock (phase ``publish``)
before it publishes, so an unpublish either sees that rollout or ends before its publish
looks for the same export.

A second publish of the same export (same :func:`~services.encoder.build.repository.export_digest`)
adds nothing and returns the version already there, so a rollout that resumes after a
crash can publish again. Concurrent publishes to one repository are serialised by a lock
file (``embed/.publish.lock``).

The GPU flavour (ensemble ``tokenizer`` → TensorRT ``encoder``) is refused: an ensemble's
steps name fixed versions of their models, so ``embed`` version N cannot route to
``encoder`` version N; serving two encoders there needs one ensemble per version (left
for later; docs/encoder.md says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.cpus import BUDGET_FILE, budget_path
from services.common.encoder_spec import EncoderSpec
from services.common.errors import FailedPrecondition, NotFound, RetrievalError, Unavailable
from services.encoder.base import version_key
from services.encoder.build.export import (
    PARITY_MIN_COSINE,
    EncoderMeta,
    check_parity,
    export_onnx,
)
from services.encoder.build.repository import (
    EMBED_MODEL,
    ENCODER_OUTPUT,
    MODELS_DIR,
    PUBLISH_LOCK,
    TOWER_ONNX,
    VERSION_FILE,
    copy_graph,
    export_digest,
    legacy_version_parameters,
    model_code,
    read_config,
    read_version_description,
    version_description,
    write_version_file,
)
from services.encoder.profiles import KINDS
from services.encoder.runtime.triton_client import triton_addresses

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2 as mc

    from services.common.tls import ClientTLS

LOAD_TIMEOUT_S = 300.0  # one load of every version of embed (each initialises ONNX Runtime)
# How long a Triton with its own copy of the repository may take to have the new version
# (the chart's repository-sync links it every intervalSeconds, 10 by default, then loads).
READY_WITHIN_S = 120.0
AWAIT_EVERY_S = 0.5


@dataclass(frozen=True)
class Export:
    """An export folder (``model.onnx``, ``tokenizer.json``, ``encoder.json``) and what
    identifies it."""

    onnx_path: Path
    meta: EncoderMeta
    digest: str


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


def _convert(model_path: Path, config: mc.ModelConfig) -> str | None:
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
            _model_code(folder)
            changed = True
    for key in [k for k in config.parameters if k.startswith("version.")]:
        del config.parameters[key]
        changed = True
    if ENCODER_OUTPUT not in {o.name for o in config.output}:
        config.output.add(name=ENCODER_OUTPUT, data_type=model_config_pb2.TYPE_STRING, dims=[1])
        changed = True
    return text_format.MessageToString(config) if changed else None


def servable_problem(config: mc.ModelConfig, export: Export, repo: Path) -> str | None:
    """Why the ``embed`` model of ``config`` cannot serve ``export`` beside its versions
    (and what would be needed), or None."""
    meta = export.meta
    where = f"{repo / config.name}"
    if config.platform == "ensemble" or config.backend != "python":
        return (
            f"{where} is the gpu flavour (ensemble of tokenizer and a TensorRT encoder): an "
            "ensemble names one version of each step, so it cannot serve a second encoder "
            "beside the first. Serving two encoders needs the cpu flavour (`encoder repo "
            "--flavor cpu`), or a second Triton model of its own for the new encoder"
        )
    widths = {o.name: list(o.dims) for o in config.output}.get("EMBEDDING", [])
    width = widths[-1] if widths else 0
    if meta.dim != width:
        return (
            f"{meta.model_name} embeds into {meta.dim} dimensions, but {where} answers "
            f"EMBEDDING [{width}] for every version it serves: one model has one output "
            f"width. A {meta.dim}-d encoder needs a Triton model of its own (a repository "
            f"generated for it with `gtr-retrieval encoder repo`, served by another Triton) "
            f"and an index rollout to that Triton"
        )
    if set(meta.max_lens) != set(KINDS):
        return (
            f"{meta.model_name}'s export has token budgets for {sorted(meta.max_lens)}, but "
            f"{where} embeds the kinds {list(KINDS)}: re-export it with `encoder export`"
        )
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str((export.onnx_path.parent / "tokenizer.json").read_text())
    except Exception as exc:  # a tokenizer the model's tokenizers cannot load
        return (
            f"{meta.model_name}'s tokenizer.json cannot be read by the `tokenizers` library "
            f"that {where}'s model runs ({exc}): it needs a fast tokenizer (tokenizer.json, "
            "as every sentence-transformers checkpoint ships)"
        )
    if not 0 <= meta.pad_id < tokenizer.get_vocab_size(with_added_tokens=True):
        return (
            f"{meta.model_name}'s pad id {meta.pad_id} is outside its tokenizer's vocabulary "
            f"of {tokenizer.get_vocab_size(with_added_tokens=True)}: re-export it"
        )
    return None


def _read_export(folder: Path, onnx_path: Path) -> Export:
    meta = EncoderMeta.read(folder)
    return Export(onnx_path, meta, export_digest(onnx_path, meta))


def _export(model_dir: Path, work: Path) -> Export:
    """``model_dir`` as an export: a checkpoint is exported into ``work`` and must pass the
    parity check; an export folder (``encoder.json`` + ``model.onnx``) or its
    ``model.onnx`` is taken as it is, re-checked against its checkpoint when that is here."""
    model_dir = Path(model_dir)
    if model_dir.suffix == ".onnx" or (model_dir / "encoder.json").exists():
        onnx_path = model_dir if model_dir.suffix == ".onnx" else model_dir / "model.onnx"
        if not onnx_path.exists():
            raise FailedPrecondition(f"no ONNX graph at {onnx_path}: run `encoder export`")
        export = _read_export(onnx_path.parent, onnx_path)
        source = Path(export.meta.source_dir)
        if (source / "modules.json").exists() or (source / "query" / "modules.json").exists():
            _parity(source, onnx_path)
        return export
    if not model_dir.is_dir():
        raise FailedPrecondition(f"no checkpoint or export at {model_dir}")
    onnx_path = work / "model.onnx"
    export_onnx(model_dir, onnx_path)
    _parity(model_dir, onnx_path)
    return _read_export(work, onnx_path)


def _parity(model_dir: Path, onnx_path: Path) -> None:
    report = check_parity(model_dir, onnx_path, threshold=PARITY_MIN_COSINE)
    if not report.passed:
        raise FailedPrecondition(f"{model_dir}: the ONNX export is refused, {report.summary()}")


@contextlib.contextmanager
def _locked(model_dir: Path) -> Iterator[None]:
    """One publish at a time per model folder (an exclusive ``flock`` on the lock file
    ``encoder repo`` wrote; opening it to lock changes no time Triton looks at)."""
    with (model_dir / PUBLISH_LOCK).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _model_code(folder: Path) -> None:
    model_code(folder, MODELS_DIR / "embed_onnx.py")


def _version_folder(folder: Path, export: Export) -> None:
    """Fill a version folder: the model code, its helpers, tokenizer, meta, graph(s) and
    its description (``version.json``)."""
    folder.mkdir(parents=True)
    _model_code(folder)
    write_version_file(folder, version_description(export.meta, export.digest))
    source = export.onnx_path.parent
    for artefact in ("tokenizer.json", "encoder.json"):
        shutil.copy2(source / artefact, folder / artefact)
    for kind, path in export.meta.onnx_files(export.onnx_path).items():
        copy_graph(path, folder / (TOWER_ONNX[kind] if export.meta.towers else TOWER_ONNX["query"]))


def _write_budget(version_dir: Path, cpus: frozenset[int]) -> None:
    """The CPU budget of the version at ``version_dir``, beside the model folders
    (:func:`~services.common.cpus.budget_path`), written before the version loads."""
    _write_atomically(Path(budget_path(str(version_dir))), ",".join(map(str, sorted(cpus))))


def clear_cpu_budgets(repo_dir: Path) -> None:
    """Remove every version's CPU budget file (the rollout that wrote it has ended; a
    stub loaded from now on may use every CPU). No version folder is touched (see
    :func:`~services.common.cpus.budget_path`), except an older release's budget file
    inside one."""
    for path in Path(repo_dir).glob(f".{EMBED_MODEL}.*.{BUDGET_FILE}"):
        path.unlink(missing_ok=True)
    for path in (Path(repo_dir) / EMBED_MODEL).glob(f"*/{BUDGET_FILE}"):
        path.unlink(missing_ok=True)


def publish_version(
    repo_dir: Path,
    model_dir: Path,
    triton_url: str | None = None,
    *,
    tls: ClientTLS | None = None,
    load_timeout_s: float = LOAD_TIMEOUT_S,
    cpus: frozenset[int] | None = None,
) -> EncoderSpec:
    """Add the encoder at ``model_dir`` (a checkpoint, or an ``encoder export`` folder) as
    the next version of ``embed`` in the repository ``repo_dir`` and, with ``triton_url``
    (one address, a list or a ``dns:`` target), make those Triton servers load it.
    ``cpus``: a rollout's CPU budget, written into the version folder (its backend stub
    runs there; :func:`clear_cpu_budgets` removes it).

    Returns the published version's :class:`EncoderSpec` (model ``embed``, version, dim,
    digest, source). FailedPrecondition, with nothing changed, when the export fails its
    parity check or the model cannot serve it (another width, a tokenizer it cannot run,
    the gpu flavour); Unavailable when a Triton could not be asked or FailedPrecondition
    when it could not load the version (the repository is put back as it was).
    """
    repo = Path(repo_dir)
    model_path = repo / EMBED_MODEL
    config_path = model_path / "config.pbtxt"
    if not config_path.exists():
        raise FailedPrecondition(
            f"{repo} has no {EMBED_MODEL} model: generate the repository first "
            "(`gtr-retrieval encoder repo --onnx ... --out ...`)"
        )
    with tempfile.TemporaryDirectory(prefix="gtr-publish-") as work:
        export = _export(Path(model_dir), Path(work))
        with _locked(model_path):
            config = read_config(config_path)
            problem = servable_problem(config, export, repo)
            if problem is not None:
                raise FailedPrecondition(f"cannot publish {model_dir}: {problem}")
            converted = _convert(model_path, config)
            if converted is not None:  # an older generator's repository, once
                _write_atomically(config_path, converted)
            versions = served_versions(repo)
            for version in versions:  # the same export published before: nothing to add
                spec = spec_of(model_path, config, version)
                if spec.digest == export.digest:
                    if cpus:
                        _write_budget(model_path / str(version), cpus)
                    if triton_url:
                        _load_everywhere(triton_url, version, tls, load_timeout_s, if_ready=False)
                    return EncoderSpec(
                        spec.model, version, spec.dim, spec.digest, export.meta.source_dir
                    )
            version = (versions[-1] if versions else 0) + 1
            _drop_stale_staging(model_path)
            staging = model_path / f".staging-{version}"  # not a number: Triton skips it
            _version_folder(staging, export)
            if cpus:
                _write_budget(model_path / str(version), cpus)
            # The folder, whole, under its number; config.pbtxt stays as it is.
            os.rename(staging, model_path / str(version))
            if triton_url:
                try:
                    _load_everywhere(triton_url, version, tls, load_timeout_s)
                except BaseException:
                    shutil.rmtree(model_path / str(version), ignore_errors=True)
                    Path(budget_path(str(model_path / str(version)))).unlink(missing_ok=True)
                    with contextlib.suppress(RetrievalError):  # unload what was loaded
                        _load_everywhere(triton_url, None, tls, load_timeout_s)
                    raise
            return EncoderSpec(
                EMBED_MODEL, version, export.meta.dim, export.digest, export.meta.source_dir
            )


def unpublish_version(
    repo_dir: Path,
    version: int,
    triton_url: str | None = None,
    *,
    tls: ClientTLS | None = None,
    load_timeout_s: float = LOAD_TIMEOUT_S,
    in_use: Callable[[], list[str]] | None = None,
) -> None:
    """Take version ``version`` of ``embed`` out of the repository and, with
    ``triton_url``, out of those Tritons (they load ``embed`` again without it).

    For an encoder no generation uses any more (``index retire``): its memory in every
    Triton is freed. NotFound for a version that is not there; FailedPrecondition for the
    last one (``embed`` would serve nothing); :class:`VersionInUse`, nothing changed, when
    ``in_use`` (asked under the publish lock: no publish runs meanwhile) names who still
    uses it. A failed load puts it back."""
    repo = Path(repo_dir)
    model_path = repo / EMBED_MODEL
    config_path = model_path / "config.pbtxt"
    if not config_path.exists():
        raise FailedPrecondition(f"{repo} has no {EMBED_MODEL} model")
    with _locked(model_path):
        # An unpublish stopped before its folder went (the policy still `specific`, the
        # folder perhaps half deleted) is finished first: its folder would otherwise be
        # taken for a version, and put back into the policy.
        converted = _convert(model_path, read_config(config_path))
        if converted is not None:
            _write_atomically(config_path, converted)
        versions = served_versions(repo)
        if version not in versions:
            raise NotFound(f"{model_path} has no version {version} (versions: {versions})")
        users = in_use() if in_use is not None else []
        if users:
            raise VersionInUse(version, users)
        if versions == [version]:
            raise FailedPrecondition(
                f"version {version} is the only version of {model_path}: it stays"
            )
        _drop_stale_staging(model_path)
        old_text = config_path.read_text()
        config = read_config(config_path)
        prefix = version_key(version, "")  # an older generator's parameters of it
        for key in [k for k in config.parameters if k.startswith(prefix)]:
            del config.parameters[key]
        from google.protobuf import text_format

        # Out of Triton's sight through the version policy (a change Triton does not
        # reload the other versions for, unlike a folder moved aside inside the model
        # folder: a non-version entry newer than their load), then the load; the folder
        # goes once Triton no longer runs it, and the policy is `all` again.
        policy = config.version_policy
        policy.specific.versions[:] = [v for v in versions if v != version]
        _write_atomically(config_path, text_format.MessageToString(config))
        if triton_url:
            try:
                _load_everywhere(triton_url, None, tls, load_timeout_s)
            except BaseException:
                _write_atomically(config_path, old_text)
                with contextlib.suppress(RetrievalError):
                    _load_everywhere(triton_url, None, tls, load_timeout_s)
                raise
        shutil.rmtree(model_path / str(version))
        Path(budget_path(str(model_path / str(version)))).unlink(missing_ok=True)
        policy.all.SetInParent()
        _write_atomically(config_path, text_format.MessageToString(config))


def _drop_stale_staging(model_path: Path) -> None:
    """Remove what a killed publish left in the model folder (under the publish lock: no
    publish is running). Left there, a ``.staging-<n>`` folder, a non-version entry newer
    than the versions' load, makes Triton reload every version at the next load. The
    staging stays inside the model folder: on the repository's root, a Triton started
    meanwhile (``--load-model=*``) takes the folder for a model, fails to load it and
    exits ("failed to load all models"; tried with this wheel's tritonserver)."""
    for stale in model_path.glob(".staging-*"):
        shutil.rmtree(stale, ignore_errors=True)


class VersionInUse(FailedPrecondition):
    """:func:`unpublish_version` refused: ``users`` (generations, a rollout) use it."""

    def __init__(self, version: int, users: list[str]) -> None:
        super().__init__(f"embed version {version} is the encoder of {', '.join(users)}")
        self.version = version
        self.users = users


def describe_versions(repo_dir: Path) -> list[EncoderSpec]:
    """Every version of ``embed`` in the repository, as its config describes it."""
    repo = Path(repo_dir)
    config_path = repo / EMBED_MODEL / "config.pbtxt"
    if not config_path.exists():
        raise FailedPrecondition(f"{repo} has no {EMBED_MODEL} model")
    config = read_config(config_path)
    return [spec_of(repo / EMBED_MODEL, config, version) for version in served_versions(repo)]


def triton_servers(url: str) -> list[str]:
    """The ``host:port`` of every Triton named by ``url`` (a ``dns:`` target resolved)."""
    from services.common.discovery import is_dns_target, parse_dns_target, resolve

    addresses = triton_addresses(url)
    if len(addresses) == 1 and is_dns_target(addresses[0]):
        resolved = asyncio.run(resolve(parse_dns_target(addresses[0])))
        if not resolved:
            raise Unavailable(f"{url} names no Triton server now")
        return resolved
    return addresses


def _load_everywhere(
    url: str,
    version: int | None,
    tls: ClientTLS | None,
    timeout_s: float,
    *,
    if_ready: bool = True,
) -> None:
    """Ask every Triton at ``url`` to load ``embed`` again and check that ``version`` (if
    given) is ready there; ``if_ready=False``: only the servers where it is not ready yet
    (a load reloads every version: not done for nothing)."""
    for address in triton_servers(url):
        if not if_ready and version is not None and _ready(address, version, tls, timeout_s):
            continue
        load_model(address, version, tls, timeout_s)


def _ready(address: str, version: int, tls: ClientTLS | None, timeout_s: float) -> bool:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from services.common.tls import channel

    with channel(address, tls) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        request = service_pb2.ModelReadyRequest(name=EMBED_MODEL, version=str(version))
        try:
            return bool(stub.ModelReady(request, timeout=timeout_s).ready)
        except grpc.RpcError:
            return False  # asked to load below, which says what is wrong


def load_model(
    address: str,
    version: int | None,
    tls: ClientTLS | None,
    timeout_s: float = LOAD_TIMEOUT_S,
    ready_within_s: float = READY_WITHIN_S,
) -> None:
    """``RepositoryModelLoad`` of ``embed`` at one Triton (it reads the repository again:
    new versions load, the loaded ones keep serving until the new model replaces them);
    then ``version`` must be ready within ``ready_within_s``. Unavailable when Triton
    cannot be asked, FailedPrecondition when it refuses the model (its message says why).

    A Triton that serves its own copy of the repository (the chart's Triton pods: a
    ``repository-sync`` sidecar links each new version folder from the shared repository
    within its interval and loads it) may answer this load before its copy has the
    version: the version is then awaited, and a version that failed to load there
    (Triton's repository index says UNAVAILABLE with the reason) ends the wait at once."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from services.common.tls import channel

    with channel(address, tls) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        try:
            stub.RepositoryModelLoad(
                service_pb2.RepositoryModelLoadRequest(model_name=EMBED_MODEL), timeout=timeout_s
            )
            if version is not None:
                _await_ready(stub, address, version, ready_within_s)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(
                    f"Triton at {address} could not be asked to load {EMBED_MODEL}: {details}"
                ) from None
            hint = (
                " (start it with --model-control-mode=explicit)"
                if ("not allowed" in details)
                else ""
            )
            raise FailedPrecondition(
                f"Triton at {address} did not load {EMBED_MODEL}"
                + (f" version {version}" if version else "")
                + f": {details}{hint}"
            ) from None


def _await_ready(stub: Any, address: str, version: int, within_s: float) -> None:
    """Until ``version`` of ``embed`` is ready at ``stub``'s Triton (see :func:`load_model`)."""
    from tritonclient.grpc import service_pb2

    until = time.monotonic() + within_s
    ready = service_pb2.ModelReadyRequest(name=EMBED_MODEL, version=str(version))
    while not stub.ModelReady(ready, timeout=max(1.0, within_s)).ready:
        index = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), timeout=within_s)
        for model in index.models:  # a version unloaded before (unpublished) says so
            if (model.name, model.version) == (EMBED_MODEL, str(version)) and (
                model.state == "UNAVAILABLE" and model.reason not in ("", "unloaded")
            ):
                raise FailedPrecondition(
                    f"Triton at {address} could not load {EMBED_MODEL} "
                    f"version {version}: {model.reason}"
                )
        if time.monotonic() >= until:
            raise FailedPrecondition(
                f"Triton at {address} loaded {EMBED_MODEL} but version {version} is not "
                f"there after {within_s:.0f} s: does it serve this repository (or a copy "
                "that a repository-sync keeps up to date)?"
            )
        time.sleep(AWAIT_EVERY_S)
