"""Generate the Triton model repository for the encoder (never hand-written).

Both flavours expose the same model ``embed``:
``TEXT`` BYTES [1] + ``KIND`` BYTES [1] → ``EMBEDDING`` FP32 [dim] + ``TRUNCATED`` BOOL [1].

* ``cpu``: ``embed`` is a Python-backend model (``triton_models/embed_onnx.py``) that
  tokenizes and runs the ONNX export with ONNX Runtime. A two-tower export (``encoder
  train --arch ade*``) puts both graphs in ``embed/1/`` and ``KIND`` picks the tower of
  each row (parameters ``onnx_file`` and ``document_onnx_file``); clients see no change.
  The model serves every version folder (``version_policy: all``): ``encoder publish``
  (``services/encoder/serve/publish.py``) adds the next encoder as ``embed/<n>/``,
  each folder with its own graph(s), tokenizer and model code, described by its own
  ``version.json`` (source model, dim, profile, digest, graph files), which the model
  reads at initialize over the shared parameters and answers on the optional output
  ``ENCODER`` (how ``TritonEncoder.connect`` learns its version's name and digest).
  ``config.pbtxt`` never changes when a version is added or removed: Triton reloads a
  loaded version on a load request when the config changed beyond ``instance_group`` /
  ``version_policy``, or when its version folder or a non-version entry of the model
  folder is newer than at its load (triton-inference-server/core,
  ``ModelLifeCycle::AsyncLoad``, ``ConfigChangeRequiresReload``,
  ``ModelTimestamp::IsModelVersionModified``). A repository of an older generator, whose
  versions are described by config parameters ``version.<n>.*``, still serves (the model
  and the client read those) and is converted by the next publish.
* ``gpu``: ``embed`` is an ensemble of ``tokenizer`` (Python backend, on CPU) and
  ``encoder`` (``tensorrt_plan``, FP16 with FP32 norms, on the GPU). With a plan, the
  max batch, the sequence buckets and the tokenizer's truncation come from the shapes
  the plan records (``<plan>.json``), and a plan built by another TensorRT release than
  the target Triton image's is refused.

The configs are built as Triton's own ``ModelConfig`` protobuf and written with
``text_format``, so a typo in a field name fails here, not in the server log.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from services.common.errors import FailedPrecondition, InvalidArgument
from services.encoder.base import QUERY_PRIORITY, version_key
from services.encoder.build.export import EncoderMeta
from services.encoder.build.plan_meta import PlanMeta
from services.encoder.build.plan_meta import plan_meta_path as plan_meta_file
from services.encoder.build.tensorrt_build import TRITON_IMAGE_TAG, TRITON_TENSORRT
from services.encoder.profiles import ModelProfile

Flavor = Literal["cpu", "gpu"]
MODELS_DIR = Path(__file__).resolve().parent / "triton_models"
TEXTCODEC = Path(__file__).resolve().parent.parent / "textcodec.py"
# Inputs and error answers shared by every Python-backend model (embed_onnx, tokenize_text).
MODEL_ERRORS = MODELS_DIR / "model_errors.py"
EMBED_MODEL = "embed"
# A two-tower export's graphs, as placed in embed/1/ (the query tower keeps model.onnx).
TOWER_ONNX = {"query": "model.onnx", "document": "document.onnx"}
# One CPU embed version's description, in its version folder (see version_description).
VERSION_FILE = "version.json"
# The CPU embed model's optional output: its version's description (JSON), answered when
# a request asks for it (TritonEncoder.connect), without running the graph.
ENCODER_OUTPUT = "ENCODER"
# The repository's publish lock (services/encoder/serve/versions.py), written with the
# model folder: a file appearing in it after Triton loaded the model would count as a
# change of every version (a non-version entry newer than their load) and reload them.
PUBLISH_LOCK = ".publish.lock"


@dataclass(frozen=True)
class RepositoryConfig:
    """How to lay the repository out; defaults come from the model's profile."""

    flavor: Flavor = "cpu"
    # CPU: one instance whose ONNX Runtime threads share the cores, spinning off (busy
    # threads stalled requests ~500 ms), preferred sizes from 16 (small batches cost more
    # per text than the hop saves) and a 1 ms delay. GPU: the profile's instances,
    # preferred sizes from 4 and a 1 ms delay. No queue policy by default: with one
    # (max_queue_size) Triton 24.10's dynamic batcher left a request that came in while
    # the instance ran in the queue until the next request arrived (up to ~0.5 s;
    # bench/triton_batcher.py, docs/encoder.md).
    instances: int | None = None  # None: 1 on CPU, the profile's on GPU
    intra_op_threads: int = 0  # ONNX Runtime threads per CPU instance; 0 = cores / instances
    allow_spinning: bool = False  # cpu: ONNX Runtime busy-waiting worker threads
    max_batch: int | None = None  # None: the profile's
    max_queue_delay_us: int | None = None  # None: 1000 (CPU and GPU)
    preferred_batch_sizes: tuple[int, ...] | None = None  # None: 16… on CPU, 4… on GPU
    # > 0: Triton rejects beyond this many queued requests (the client says Overloaded);
    # 0: no queue policy (see above: the bound costs a stall in Triton 24.10)
    max_queue_size: int = 0
    # PRIORITY_LEVELS: queries (QUERY_PRIORITY) before the index builder's document
    # batches (DOCUMENT_PRIORITY); 0: one queue, in arrival order (the default). Priority
    # levels cost the queue policy's stall: a request that arrived while the instance ran
    # waited for the next arrival, ~0.5 s on a quiet model (bench/triton_batcher.py: worst
    # late arrival 512 ms with levels, 14-30 ms without; it broke the local stack's 50 ms
    # p99 at 5 searches/s). docs/encoder.md "Triton's queue policy".
    priority_levels: int = 0
    seq_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)  # gpu: pad-to lengths
    plan_path: Path | None = None  # gpu: copy this TensorRT plan into encoder/1/
    triton_image_tag: str = TRITON_IMAGE_TAG  # gpu: the Triton image that will load the plan
    extra_parameters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Repository:
    root: Path
    models: tuple[str, ...]
    meta: EncoderMeta

    def config_path(self, model: str) -> Path:
        return self.root / model / "config.pbtxt"


def _tensor(name: str, dtype: int, dims: list[int]) -> tuple[str, int, list[int]]:
    return name, dtype, dims


def _add_io(
    config: mc.ModelConfig,
    inputs: list[tuple[str, int, list[int]]],
    outputs: list[tuple[str, int, list[int]]],
) -> None:
    for name, dtype, dims in inputs:
        config.input.add(name=name, data_type=dtype, dims=dims)  # type: ignore[arg-type]
    for name, dtype, dims in outputs:
        config.output.add(name=name, data_type=dtype, dims=dims)  # type: ignore[arg-type]


def _text_io(dim: int) -> tuple[list[tuple[str, int, list[int]]], list[tuple[str, int, list[int]]]]:
    inputs = [_tensor("TEXT", mc.TYPE_STRING, [1]), _tensor("KIND", mc.TYPE_STRING, [1])]
    outputs = [_tensor("EMBEDDING", mc.TYPE_FP32, [dim]), _tensor("TRUNCATED", mc.TYPE_BOOL, [1])]
    return inputs, outputs


def _params(config: mc.ModelConfig, values: dict[str, str]) -> None:
    for key, value in values.items():
        config.parameters[key].string_value = value


CPU_PREFERRED_FROM = 16  # CPU batches below this cost more per text than the hop saves
QUEUE_DELAY_US = 1000  # a lone request waits at most this for company


def _batching(config: mc.ModelConfig, max_batch: int, cfg: RepositoryConfig) -> None:
    smallest = CPU_PREFERRED_FROM if cfg.flavor == "cpu" else 4
    default = tuple(s for s in (4, 8, 16, 32, 64) if smallest <= s <= max_batch)
    sizes = [s for s in (cfg.preferred_batch_sizes or default) if s <= max_batch] or [max_batch]
    delay = QUEUE_DELAY_US if cfg.max_queue_delay_us is None else cfg.max_queue_delay_us
    config.dynamic_batching.preferred_batch_size.extend(sizes)
    config.dynamic_batching.max_queue_delay_microseconds = delay
    if cfg.priority_levels:
        config.dynamic_batching.priority_levels = cfg.priority_levels
        config.dynamic_batching.default_priority_level = QUERY_PRIORITY
    if cfg.max_queue_size > 0:
        config.dynamic_batching.default_queue_policy.max_queue_size = cfg.max_queue_size


def _common_params(meta: EncoderMeta) -> dict[str, str]:
    """What a client reads back from the config: model name, width, profile."""
    return {"source_model": meta.model_name, "dim": str(meta.dim), "profile": meta.profile}


def export_digest(onnx_path: Path, meta: EncoderMeta) -> str:
    """What identifies an encoder's vectors: SHA-256 (first 16 hex digits) of its
    graph(s), its tokenizer and its token budgets. Two versions with one digest embed
    alike; ``encoder publish`` of an already published export adds nothing."""
    digest = hashlib.sha256()
    for kind, path in sorted(meta.onnx_files(Path(onnx_path)).items()):
        digest.update(kind.encode() + b"\0")
        with Path(path).open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    digest.update((Path(onnx_path).parent / "tokenizer.json").read_bytes())
    digest.update(json.dumps([meta.max_lens, meta.pad_id], sort_keys=True).encode())
    return digest.hexdigest()[:16]


def version_description(meta: EncoderMeta, digest: str) -> dict[str, str]:
    """What ``version.json`` says of one CPU ``embed`` version: what the client reads
    (source model, dim, profile, digest) and the graph files its model runs."""
    return {
        **_common_params(meta),
        "digest": digest,
        "onnx_file": TOWER_ONNX["query"],
        "document_onnx_file": TOWER_ONNX["document"] if meta.towers else "",
    }


def write_version_file(folder: Path, description: dict[str, str]) -> None:
    """``version.json`` in a version folder (before Triton sees the folder)."""
    (Path(folder) / VERSION_FILE).write_text(json.dumps(description, indent=1, sort_keys=True))


def legacy_version_parameters(config: mc.ModelConfig, version: int) -> dict[str, str]:
    """The ``version.<n>.*`` parameters an older generator wrote for ``version`` (its
    keys without the prefix); empty for a repository of this one."""
    prefix = version_key(version, "")
    return {
        k[len(prefix) :]: v.string_value
        for k, v in config.parameters.items()
        if k.startswith(prefix)
    }


def read_version_description(
    model_dir: Path, config: mc.ModelConfig, version: int
) -> dict[str, str]:
    """One version's description: the shared parameters overlaid with an older
    generator's ``version.<n>.*`` ones and with the folder's ``version.json``; one that
    is not a JSON object (edited by hand, cut short) is :class:`FailedPrecondition`
    naming the file."""
    shared = {
        k: v.string_value for k, v in config.parameters.items() if not k.startswith("version.")
    }
    path = Path(model_dir) / str(version) / VERSION_FILE
    try:
        own = json.loads(path.read_text()) if path.exists() else {}
    except ValueError as exc:
        raise FailedPrecondition(f"{path} is not the JSON a publish writes: {exc}") from None
    if not isinstance(own, dict):
        raise FailedPrecondition(f"{path} is not the JSON object a publish writes")
    return {**shared, **legacy_version_parameters(config, version), **own}


def cpu_embed_config(
    meta: EncoderMeta, profile: ModelProfile, cfg: RepositoryConfig
) -> mc.ModelConfig:
    max_batch = cfg.max_batch or profile.max_batch
    config = mc.ModelConfig(name=EMBED_MODEL, backend="python", max_batch_size=max_batch)
    inputs, outputs = _text_io(meta.dim)
    _add_io(config, inputs, [*outputs, _tensor(ENCODER_OUTPUT, mc.TYPE_STRING, [1])])
    _batching(config, max_batch, cfg)
    config.instance_group.add(count=cfg.instances or 1, kind=mc.ModelInstanceGroup.KIND_CPU)
    threads = str(cfg.intra_op_threads)
    spinning = "1" if cfg.allow_spinning else "0"
    towers = {"document_onnx_file": TOWER_ONNX["document"]} if meta.towers else {}
    _params(
        config,
        {
            **_common_params(meta),
            "onnx_file": "model.onnx",
            **towers,
            "intra_op_threads": threads,
            "allow_spinning": spinning,
            **cfg.extra_parameters,
        },
    )
    # every version folder is served: encoder publish adds versions beside the first
    config.version_policy.all.SetInParent()
    return config


def _warmup(config: mc.ModelConfig, max_batch: int, buckets: tuple[int, ...]) -> None:
    """Triton runs these requests on every instance before the model is READY: one per
    token bucket the tokenizer pads to (batch 1), and the largest batch at the longest
    bucket, so the first real requests do not pay CUDA's lazy module loading and
    TensorRT's first-run setup of each shape (zeros: the pad id, a fully masked row)."""
    shapes = [(1, b) for b in buckets] + [(max_batch, max(buckets))]
    for batch, seq in shapes:
        warm = config.model_warmup.add(name=f"b{batch}_s{seq}", batch_size=batch, count=1)
        for name in ("input_ids", "attention_mask"):
            warm.inputs[name].data_type = mc.TYPE_INT64
            warm.inputs[name].dims.append(seq)
            warm.inputs[name].zero_data = True


def gpu_configs(
    meta: EncoderMeta, profile: ModelProfile, cfg: RepositoryConfig
) -> dict[str, mc.ModelConfig]:
    """``tokenizer`` (Python, CPU) → ``encoder`` (TensorRT, GPU), glued by ensemble ``embed``."""
    max_batch = cfg.max_batch or profile.max_batch
    text_in, text_out = _text_io(meta.dim)
    ids = [
        _tensor("INPUT_IDS", mc.TYPE_INT64, [-1]),
        _tensor("ATTENTION_MASK", mc.TYPE_INT64, [-1]),
    ]

    tok = mc.ModelConfig(name="tokenizer", backend="python", max_batch_size=max_batch)
    _add_io(tok, text_in, [*ids, _tensor("TRUNCATED", mc.TYPE_BOOL, [1])])
    tok.instance_group.add(count=2, kind=mc.ModelInstanceGroup.KIND_CPU)
    _params(tok, {**_common_params(meta), "seq_buckets": ",".join(map(str, cfg.seq_buckets))})

    enc = mc.ModelConfig(name="encoder", platform="tensorrt_plan", max_batch_size=max_batch)
    _add_io(
        enc,
        [_tensor("input_ids", mc.TYPE_INT64, [-1]), _tensor("attention_mask", mc.TYPE_INT64, [-1])],
        [_tensor("embedding", mc.TYPE_FP32, [meta.dim])],
    )
    _batching(enc, max_batch, cfg)
    enc.instance_group.add(
        count=cfg.instances or profile.triton_instances, kind=mc.ModelInstanceGroup.KIND_GPU
    )
    _params(enc, _common_params(meta))
    _warmup(enc, max_batch, cfg.seq_buckets)

    embed = mc.ModelConfig(name=EMBED_MODEL, platform="ensemble", max_batch_size=max_batch)
    _add_io(embed, text_in, text_out)
    step = embed.ensemble_scheduling.step.add(model_name="tokenizer", model_version=-1)
    step.input_map.update({"TEXT": "TEXT", "KIND": "KIND"})
    step.output_map.update({"INPUT_IDS": "ids", "ATTENTION_MASK": "mask", "TRUNCATED": "TRUNCATED"})
    step = embed.ensemble_scheduling.step.add(model_name="encoder", model_version=-1)
    step.input_map.update({"input_ids": "ids", "attention_mask": "mask"})
    step.output_map.update({"embedding": "EMBEDDING"})
    _params(embed, _common_params(meta))
    return {"tokenizer": tok, "encoder": enc, EMBED_MODEL: embed}


def copy_graph(src: Path, dst: Path) -> None:
    """A CPU ``embed`` version's own copy of an ONNX graph, never a hard link: a link
    shares the inode, whose ctime changes whenever another link to it is made or removed
    (``encoder publish``'s temporary export cleaned up, the export folder deleted, another
    repository generated from it), and Triton takes a newer ctime under a version folder
    for a change of that version and reloads it at the next load request."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def _place(src: Path, dst: Path) -> None:
    """Hard-link big artefacts when on the same filesystem, copy otherwise (the gpu
    flavour's plan: one version, see :func:`copy_graph`)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _write_config(root: Path, config: mc.ModelConfig) -> None:
    model_dir = root / config.name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))


def model_code(folder: Path, source: Path) -> None:
    """A Python-backend version folder's code: ``model.py`` (from ``source``) and its
    helpers, compiled into ``__pycache__`` here. Else the backend stub writes the bytecode
    into the folder after Triton read the folder's time at load, and Triton takes the
    version for modified at the next load request (an ``encoder publish``) and reloads
    it (the stub compiles ``model.py`` whatever ``PYTHONDONTWRITEBYTECODE`` says)."""
    import importlib.util
    import py_compile

    for src, name in (
        (source, "model.py"),
        (TEXTCODEC, "textcodec.py"),
        (MODEL_ERRORS, "model_errors.py"),
    ):
        shutil.copy2(src, folder / name)
        path = str(folder / name)
        py_compile.compile(path, cfile=importlib.util.cache_from_source(path), doraise=True)


def _python_model(root: Path, name: str, source: Path, export_dir: Path) -> None:
    version = root / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    model_code(version, source)
    for artefact in ("tokenizer.json", "encoder.json"):
        shutil.copy2(export_dir / artefact, version / artefact)


def plan_for_triton(plan_path: Path, image_tag: str) -> PlanMeta:
    """The plan's metadata, after checking that Triton ``image_tag`` can load the plan."""
    if not plan_path.exists():
        raise FailedPrecondition(f"no TensorRT plan at {plan_path}")
    meta = PlanMeta.read(plan_path)
    tensorrt = TRITON_TENSORRT.get(image_tag)
    if tensorrt is None:
        raise FailedPrecondition(
            f"which TensorRT Triton {image_tag} ships is not known here (known: "
            f"{sorted(TRITON_TENSORRT)}): add it to TRITON_TENSORRT in tensorrt_build.py"
        )
    meta.check_tensorrt(tensorrt, f"Triton {image_tag}")
    return meta


def fit_to_plan(cfg: RepositoryConfig, plan: PlanMeta) -> RepositoryConfig:
    """``cfg`` with max batch and sequence buckets inside the shapes the plan was built for.

    The max batch is the plan's (a larger one is refused: Triton would send batches the
    engine has no profile for); the buckets are those within the plan's sequence range,
    plus its maximum, so that every padded batch has a shape the plan covers.
    """
    (_, min_seq), (max_batch, max_seq) = plan.min_shape, plan.max_shape
    if cfg.max_batch is not None and cfg.max_batch > max_batch:
        raise InvalidArgument(
            f"max_batch {cfg.max_batch} exceeds the plan's maximum batch {max_batch}: "
            "rebuild the plan with `build-plan --max-batch` or lower --max-batch"
        )
    buckets = sorted({b for b in cfg.seq_buckets if min_seq <= b <= max_seq} | {max_seq})
    return replace(cfg, max_batch=cfg.max_batch or max_batch, seq_buckets=tuple(buckets))


def generate_repository(
    onnx_path: Path, out_dir: Path, cfg: RepositoryConfig | None = None
) -> Repository:
    """Write the ``cfg.flavor`` repository for the export at ``onnx_path`` into ``out_dir``.

    Model folders this function owns are replaced; anything else in ``out_dir`` stays.
    """
    cfg = cfg or RepositoryConfig()
    onnx_path = Path(onnx_path)
    if not onnx_path.exists():
        raise FailedPrecondition(f"no ONNX export at {onnx_path}: run `encoder export` first")
    export_dir = onnx_path.parent
    meta = EncoderMeta.read(export_dir)
    if meta.towers and cfg.flavor == "gpu":  # refused before anything in out_dir is touched
        raise FailedPrecondition(
            f"{onnx_path.parent} is a two-tower export ({meta.model_name}): the gpu flavour "
            "serves one TensorRT plan; serve it with --flavor cpu (docs/encoder.md)"
        )
    profile = meta.profile_obj
    root = Path(out_dir)
    owned = ("embed", "tokenizer", "encoder")
    for name in owned:
        shutil.rmtree(root / name, ignore_errors=True)
    if cfg.flavor == "cpu":
        config = cpu_embed_config(meta, profile, cfg)
        _write_config(root, config)
        (root / EMBED_MODEL / PUBLISH_LOCK).touch()
        _python_model(root, EMBED_MODEL, MODELS_DIR / "embed_onnx.py", export_dir)
        write_version_file(
            root / EMBED_MODEL / "1", version_description(meta, export_digest(onnx_path, meta))
        )
        if meta.towers:
            for kind, path in meta.onnx_files(onnx_path).items():
                copy_graph(path, root / EMBED_MODEL / "1" / TOWER_ONNX[kind])
        else:
            copy_graph(onnx_path, root / EMBED_MODEL / "1" / "model.onnx")
        return Repository(root, (EMBED_MODEL,), meta)
    if cfg.flavor != "gpu":
        raise InvalidArgument(f"unknown flavour {cfg.flavor!r}: use cpu or gpu")
    plan_meta = None
    if cfg.plan_path is not None:
        plan_meta = plan_for_triton(Path(cfg.plan_path), cfg.triton_image_tag)
        cfg = fit_to_plan(cfg, plan_meta)
    configs = gpu_configs(meta, profile, cfg)
    if plan_meta is not None:  # exported by the tokenizer as gtr_encoder_plan_info
        _params(
            configs["tokenizer"],
            {
                "plan_precision": plan_meta.precision,
                "plan_tensorrt_version": plan_meta.tensorrt_version,
                "plan_gpu": plan_meta.gpu,
            },
        )
    for config in configs.values():
        _write_config(root, config)
    _python_model(root, "tokenizer", MODELS_DIR / "tokenize_text.py", export_dir)
    if plan_meta is not None:  # truncate where the plan ends, not at the model's budget
        longest = plan_meta.max_shape[1]
        capped = {kind: min(n, longest) for kind, n in meta.max_lens.items()}
        tok_meta = root / "tokenizer" / "1" / "encoder.json"
        tok_meta.write_text(json.dumps({**json.loads(tok_meta.read_text()), "max_lens": capped}))
    (root / EMBED_MODEL / "1").mkdir(parents=True, exist_ok=True)  # ensembles need a version
    plan_dir = root / "encoder" / "1"
    plan_dir.mkdir(parents=True, exist_ok=True)
    if cfg.plan_path is not None:
        _place(Path(cfg.plan_path), plan_dir / "model.plan")
        shutil.copy2(plan_meta_file(Path(cfg.plan_path)), plan_dir / "model.plan.json")
    else:
        (plan_dir / "README").write_text(
            "Put the TensorRT plan here as model.plan:\n"
            "  gtr-retrieval encoder build-plan --onnx <export>/model.onnx "
            f"--out {plan_dir / 'model.plan'}\n"
        )
    return Repository(root, ("tokenizer", "encoder", EMBED_MODEL), meta)


def read_config(path: Path) -> mc.ModelConfig:
    """Parse a ``config.pbtxt`` with Triton's own schema (used by tests and ``repo --check``)."""
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig())
