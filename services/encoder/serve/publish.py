"""Publish an encoder as the next version of ``embed``: ``encoder publish`` (issue #24).

:func:`publish_version` exports a checkpoint (the parity check gates it, as ``encoder
export``), refuses one the model cannot serve (FailedPrecondition saying what would be
needed; nothing in the repository changes), adds it as version N+1 and makes a running
Triton load it without a restart.

A second publish of the same export (same :func:`~services.encoder.build.repository.export_digest`)
adds nothing and returns the version already there, so a rollout that resumes after a
crash can publish again. Concurrent publishes to one repository are serialised by a lock
file (``embed/.publish.lock``).

The GPU flavour (ensemble ``tokenizer`` → TensorRT ``encoder``) is refused: an ensemble's
steps name fixed versions of their models, so ``embed`` version N cannot route to
``encoder`` version N; serving two encoders there needs one ensemble per version (left
for later; docs/encoder.md says so).

The repository's side (lock, staging, conversion) is :mod:`services.encoder.serve.versions`;
the loads :mod:`services.encoder.serve.triton_load`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.encoder_spec import EncoderSpec
from services.common.errors import FailedPrecondition, RetrievalError
from services.encoder.build import parity_record
from services.encoder.build.export import (
    PARITY_MIN_COSINE,
    EncoderMeta,
    export_onnx,
)
from services.encoder.build.int8_recheck import recheck_int8
from services.encoder.build.repository import (
    EMBED_MODEL,
    TOWER_ONNX,
    copy_graph,
    export_digest,
    read_config,
    version_description,
    write_version_file,
)
from services.encoder.profiles import KINDS
from services.encoder.serve.triton_load import LOAD_TIMEOUT_S, load_everywhere
from services.encoder.serve.versions import (
    convert_older,
    drop_stale_staging,
    locked,
    model_code_into,
    served_versions,
    spec_of,
    write_atomically,
    write_budget,
)
from services.process.cpus import budget_path, running
from services.process.private import is_private, make_private

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2 as mc

    from services.rpc.tls import ClientTLS

log = logging.getLogger(__name__)

# A publish's scratch folder (a checkpoint's export) in the temporary directory, named for
# its process: one killed (-9) cannot remove its own, the next publish removes it.
SCRATCH_PREFIX = "gtr-publish-"


@dataclass(frozen=True)
class Export:
    """An export folder (``model.onnx``, ``tokenizer.json``, ``encoder.json``) and what
    identifies it."""

    onnx_path: Path
    meta: EncoderMeta
    digest: str


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


def _export(model_dir: Path, work: Path, *, int8_unmeasured: bool = False) -> Export:
    """``model_dir`` as an export: a checkpoint is exported into ``work`` and must pass the
    parity check; an export folder (``encoder.json`` + ``model.onnx``) or its
    ``model.onnx`` is taken as it is, re-checked against its checkpoint when that is here,
    and its int8 graphs checked again (:func:`~services.encoder.build.int8_recheck.recheck_int8`:
    parity here, a quality result of these graphs, or ``int8_unmeasured``)."""
    model_dir = Path(model_dir)
    if model_dir.suffix == ".onnx" or (model_dir / "encoder.json").exists():
        onnx_path = model_dir if model_dir.suffix == ".onnx" else model_dir / "model.onnx"
        if not onnx_path.exists():
            raise FailedPrecondition(f"no ONNX graph at {onnx_path}: run `encoder export`")
        export = _read_export(onnx_path.parent, onnx_path)
        source = Path(export.meta.source_dir)
        if (source / "modules.json").exists() or (source / "query" / "modules.json").exists():
            _parity(source, onnx_path)
        checked = recheck_int8(onnx_path, export.meta, unmeasured=int8_unmeasured)
        if checked is not None:
            (log.info if checked.measured else log.warning)("%s", checked.note)
        return export
    if not model_dir.is_dir():
        raise FailedPrecondition(f"no checkpoint or export at {model_dir}")
    onnx_path = work / "model.onnx"
    export_onnx(model_dir, onnx_path)
    _parity(model_dir, onnx_path, keep=False)  # a scratch export: no record to keep
    return _read_export(work, onnx_path)


def _parity(model_dir: Path, onnx_path: Path, *, keep: bool = True) -> None:
    """The export's parity with its checkpoint: its record (``parity.json``) when the same
    graphs and checkpoint bytes are there again, else checked in PyTorch and recorded
    when ``keep`` (:mod:`~services.encoder.build.parity_record`)."""
    report, from_record = parity_record.checked(model_dir, onnx_path, PARITY_MIN_COSINE, keep=keep)
    if not report.passed:
        raise FailedPrecondition(f"{model_dir}: the ONNX export is refused, {report.summary()}")
    if from_record:
        log.info(
            "%s: %s, as recorded at export (the same graphs and checkpoint)",
            onnx_path,
            report.summary(),
        )


def _version_folder(folder: Path, export: Export) -> None:
    """Fill a version folder: the model code, its helpers, tokenizer, meta, graph(s) and
    its description (``version.json``)."""
    folder.mkdir(parents=True)
    model_code_into(folder)
    write_version_file(folder, version_description(export.meta, export.digest))
    source = export.onnx_path.parent
    for artefact in ("tokenizer.json", "encoder.json"):
        shutil.copy2(source / artefact, folder / artefact)
    for kind, path in export.meta.onnx_files(export.onnx_path).items():
        copy_graph(path, folder / (TOWER_ONNX[kind] if export.meta.towers else TOWER_ONNX["query"]))


def publish_version(
    repo_dir: Path,
    model_dir: Path,
    triton_url: str | None = None,
    *,
    tls: ClientTLS | None = None,
    load_timeout_s: float = LOAD_TIMEOUT_S,
    cpus: frozenset[int] | None = None,
    int8_unmeasured: bool = False,
) -> EncoderSpec:
    """Add the encoder at ``model_dir`` (a checkpoint, or an ``encoder export`` folder) as
    the next version of ``embed`` in the repository ``repo_dir`` and, with ``triton_url``
    (one address, a list or a ``dns:`` target), make those Triton servers load it.
    ``cpus``: a rollout's CPU budget, written into the version folder (its backend stub
    runs there; :func:`~services.encoder.serve.versions.clear_cpu_budgets` removes it).
    ``int8_unmeasured``: serve an export's int8 graphs whose quality no gate result holds
    for (their parity is checked either way; refused without it).

    Returns the published version's :class:`EncoderSpec` (model ``embed``, version, dim,
    digest, source). FailedPrecondition, with nothing changed, when the export fails its
    parity check, its int8 graphs fail theirs or have no quality result (above), or the
    model cannot serve it (another width, a tokenizer it cannot run, the gpu flavour);
    Unavailable when a Triton could not be asked or FailedPrecondition when it could not
    load the version (the repository is put back as it was).
    """
    repo = Path(repo_dir)
    model_path = repo / EMBED_MODEL
    config_path = model_path / "config.pbtxt"
    if not config_path.exists():
        raise FailedPrecondition(
            f"{repo} has no {EMBED_MODEL} model: generate the repository first "
            "(`gtr-retrieval encoder repo --onnx ... --out ...`)"
        )
    drop_dead_scratch()
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-") as work:
        export = _export(Path(model_dir), Path(work), int8_unmeasured=int8_unmeasured)
        with locked(model_path):
            config = read_config(config_path)
            problem = servable_problem(config, export, repo)
            if problem is not None:
                raise FailedPrecondition(f"cannot publish {model_dir}: {problem}")
            converted = convert_older(model_path, config)
            if converted is not None:  # an older generator's repository, once
                write_atomically(config_path, converted)
            versions = served_versions(repo)
            for version in versions:  # the same export published before: nothing to add
                spec = spec_of(model_path, config, version)
                if spec.digest == export.digest:
                    if cpus:
                        write_budget(model_path / str(version), cpus)
                    if triton_url:
                        load_everywhere(triton_url, version, tls, load_timeout_s, if_ready=False)
                    return EncoderSpec(
                        spec.model, version, spec.dim, spec.digest, export.meta.source_dir
                    )
            version = (versions[-1] if versions else 0) + 1
            drop_stale_staging(model_path)
            staging = model_path / f".staging-{version}"  # not a number: Triton skips it
            _version_folder(staging, export)
            if is_private(model_path):
                # a repository kept for its owner (the local stack's run directory):
                # so is the version, whatever the publishing command's umask
                make_private(staging)
            if cpus:
                write_budget(model_path / str(version), cpus)
            # The folder, whole, under its number; config.pbtxt stays as it is.
            os.rename(staging, model_path / str(version))
            if triton_url:
                try:
                    load_everywhere(triton_url, version, tls, load_timeout_s)
                except BaseException:
                    shutil.rmtree(model_path / str(version), ignore_errors=True)
                    Path(budget_path(str(model_path / str(version)))).unlink(missing_ok=True)
                    with contextlib.suppress(RetrievalError):  # unload what was loaded
                        load_everywhere(triton_url, None, tls, load_timeout_s)
                    raise
            return EncoderSpec(
                EMBED_MODEL, version, export.meta.dim, export.digest, export.meta.source_dir
            )


def drop_dead_scratch(folder: Path | None = None) -> list[Path]:
    """Remove the scratch folders that publishes killed before their cleanup left in
    ``folder`` (the temporary directory): those whose process is gone. A live one's, and
    another user's (not ours to remove), stay. Returns what was removed."""
    removed = []
    for path in Path(folder or tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or running(int(pid)) or not path.is_dir():
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed
