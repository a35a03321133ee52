"""TensorRT FP16 plan for the GTR encoder, with T5's overflow-prone layers kept in FP32.

T5 was trained in bfloat16; its activations exceed FP16's range (65504) in places, and
a naive FP16 engine returns garbage, NaN or all zeros (TensorRT issue 3206; Hugging Face
keeps ``wo`` in fp32 for the same reason). The remedy here:

* find, in the ONNX graph, the RMSNorm pattern of T5 (``Pow(x, 2) → ReduceMean → Add(eps)
  → Sqrt → Div/Reciprocal → Mul(x, ·) → Mul(weight, ·)``; also ONNX ``LayerNormalization``
  and its decomposed form for BERT), the residual adds that feed those norms, the FFN
  output projection ``wo``, and everything after the last norm (pooling, dense,
  normalise): :func:`select_fp32_nodes`;
* cast the ONNX graph to FP16 except those nodes (ONNX Runtime's maintained float16
  converter with a node block list, :func:`fp16_graph`; both in :mod:`.onnx_fp16`) and
  build a *strongly typed* network from it, so that TensorRT runs each tensor in the type
  the graph gives it:
  per-layer precision hints are ignored inside fused regions (TensorRT issues 3889,
  3941), types are not;
* build, run a probe batch at the profile's maximum shape (max batch × max sequence),
  compare with PyTorch fp32, and *refuse to write* a plan with a non-finite value, a
  zero-norm row or a cosine below 0.999 on any row (:func:`check_embeddings`); then an
  FP32 plan is tried (``--precision auto``), and written only if it passes the same gate;
* record in ``<plan>.json`` the TensorRT version that built it, its precision and its
  shapes: a plan only loads in the TensorRT version that built it (Triton rejects
  others, triton-inference-server issue 7613), and the Triton repository takes its
  max batch and sequence buckets from these shapes (:mod:`.repository`; the file and its
  write: :mod:`.plan_meta`).

The graph analysis and the FP16 cast are pure ``onnx``/``onnxruntime`` and run (and are
tested) anywhere; ``tensorrt`` and CUDA are imported only inside :func:`build_plan`.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from services.common.errors import FailedPrecondition, InvalidArgument
from services.encoder.build.export import check_embeddings
from services.encoder.build.onnx_fp16 import fp16_graph, select_fp32_nodes
from services.encoder.build.plan_meta import PlanMeta, Precision, place_plan, tensorrt_release
from services.encoder.profiles import ModelProfile

log = logging.getLogger(__name__)

PLAN_MIN_COSINE = 0.999
NO_TRT_REASON = "no GPU/TensorRT on this machine"

# The Triton image the Helm chart serves plans with (deploy/k8s/gtr-retrieval/values.yaml,
# encoder.image.gpu.tag) and the TensorRT inside it (NGC frameworks support matrix:
# 24.12 ships TensorRT 10.7.0.23). A plan loads only in the TensorRT release that built
# it, so the gpu extra pins this release and build-plan refuses any other.
TRITON_IMAGE_TAG = "24.12-py3"
TRITON_TENSORRT: dict[str, str] = {"24.12-py3": "10.7.0"}
TENSORRT_VERSION = TRITON_TENSORRT[TRITON_IMAGE_TAG]
# The CUDA release of each Triton image (NVIDIA's Triton release notes: 24.12 is based on
# CUDA 12.6.3, which needs driver R560+, or R470/R525/R535/R545 on data center GPUs). The
# GPU image's torch, faiss-gpu, TensorRT and onnxruntime-gpu use its major, so one driver
# serves both (deploy/docker/check_cuda.py at build time, :func:`check_cuda` here).
TRITON_CUDA: dict[str, str] = {"24.12-py3": "12.6"}
TRITON_DRIVER = "R560 or later, or R535/R545 on data center GPUs"


def check_cuda(torch_cuda: str | None, available: bool, image_tag: str = TRITON_IMAGE_TAG) -> None:
    """FailedPrecondition unless this torch is a CUDA build of the Triton image's CUDA
    major and sees a GPU (issue #37 item 1: a CUDA 13 torch on an R535-R570 node sees none)."""
    want = TRITON_CUDA[image_tag]
    fix = "install torch==2.13.0+cu126 (the PyTorch cu126 index; PyPI's 2.13.0 is CUDA 13)"
    if torch_cuda is None:
        raise FailedPrecondition(f"{NO_TRT_REASON} (this torch is a CPU build): {fix}")
    if torch_cuda.split(".")[0] != want.split(".")[0]:
        raise FailedPrecondition(
            f"this torch is built for CUDA {torch_cuda}, and Triton {image_tag} runs CUDA "
            f"{want} (its driver: {TRITON_DRIVER}; CUDA 13 needs R580+): {fix}"
        )
    if not available:
        raise FailedPrecondition(
            f"{NO_TRT_REASON} (torch.cuda.is_available() is False: torch {torch_cuda} needs an "
            f"NVIDIA driver {TRITON_DRIVER}, and the pod a GPU: nvidia.com/gpu, "
            "gpu.runtimeClassName)"
        )


# What to do when the gate refuses; names flags of `gtr-retrieval encoder build-plan`.
MORE_FP32_HINT = (
    "keep more ONNX nodes in FP32 with --extra-fp32-nodes NODE[,NODE...] or build an FP32 "
    "plan with --precision fp32"
)


@dataclass(frozen=True)
class PlanConfig:
    """Shapes and budget of the engine; defaults from the profile."""

    min_shape: tuple[int, int] = (1, 1)
    opt_shape: tuple[int, int] = (8, 128)
    max_shape: tuple[int, int] = (64, 512)
    workspace_gb: float = 4.0
    keep_ffn_out_fp32: bool = True
    min_cosine: float = PLAN_MIN_COSINE
    extra_fp32_nodes: frozenset[str] = field(default_factory=frozenset)
    precision: Literal["auto", "fp16", "fp32"] = "auto"  # auto: FP16, else an FP32 plan
    # the disk the plan may take (the chart's encoder.profiles.<size>.planStorage, the
    # /models emptyDir's limit); an FP32 plan that would not fit is not built. None: any
    max_plan_bytes: int | None = None

    @classmethod
    def for_profile(cls, profile: ModelProfile) -> PlanConfig:
        # opt: batch 8 of 128-token inputs, the GTR paper's latency point, between the
        # typical query (32) and document (256) lengths of the profile.
        return cls(
            opt_shape=(min(8, profile.max_batch), 128),
            max_shape=(profile.max_batch, profile.document_max_len),
        )

    @property
    def attempts(self) -> tuple[Precision, ...]:
        return ("fp16", "fp32") if self.precision == "auto" else (self.precision,)


@dataclass(frozen=True)
class PlanReport:
    plan_path: Path | None
    min_cosine: float
    fp32_layers: int
    total_layers: int
    precision: Precision = "fp16"
    rejected: tuple[str, ...] = ()  # why earlier attempts (e.g. FP16) were refused
    inspected_layers: int = 0  # engine layers whose ONNX nodes the inspector named


class PlanParityError(FailedPrecondition):
    """The engine disagrees with PyTorch; no plan was written."""


def fp32_plan_bytes(onnx_path: Path) -> int:
    """About the size of an FP32 plan of the export at ``onnx_path``: its FP32 weights, the
    .onnx file and the external data files it names (an engine stores the weights once;
    docs/deploy.md gives ~4.9 GB for xl and ~19 GB for xxl)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    files = {
        entry.value
        for tensor in model.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    del model
    folder = Path(onnx_path).parent
    return Path(onnx_path).stat().st_size + sum((folder / f).stat().st_size for f in files)


def plan_attempts(cfg: PlanConfig, fp32_bytes: int) -> tuple[tuple[Precision, ...], str]:
    """The precisions to try, and why the FP32 fallback is left out ("" when it is not):
    an FP32 plan larger than ``cfg.max_plan_bytes`` would fill the pod's disk midway
    (issue #37 item 5: xl's ~4.9 GB against 4Gi, xxl's ~19 GB against 16Gi)."""
    limit = cfg.max_plan_bytes
    if limit is None or fp32_bytes <= limit or "fp32" not in cfg.attempts:
        return cfg.attempts, ""
    why = (
        f"an FP32 plan of this export takes ~{fp32_bytes / 1e9:.1f} GB, more than the "
        f"{limit / 1e9:.1f} GB of --max-plan-bytes (the chart's "
        "encoder.profiles.<size>.planStorage; raise it, and planMemory, to allow FP32)"
    )
    if cfg.precision == "fp32":
        raise InvalidArgument(f"--precision fp32 refused: {why}")
    return ("fp16",), f"the FP32 fallback refused: {why}"


def _require_tensorrt() -> Any:
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise FailedPrecondition(f"{NO_TRT_REASON} (import tensorrt failed: {exc})") from None
    installed = str(getattr(trt, "__version__", "unknown"))
    if tensorrt_release(installed) != TENSORRT_VERSION:
        raise FailedPrecondition(
            f"TensorRT {installed} is installed, but Triton {TRITON_IMAGE_TAG} (the chart's "
            f"image) loads only plans of TensorRT {TENSORRT_VERSION}: install the pinned one "
            "with `pip install '.[gpu]'`"
        )
    import torch

    check_cuda(torch.version.cuda, torch.cuda.is_available())
    return trt


_ONNX_LAYER = re.compile(r"\[ONNX Layer: ([^\]]+)\]")


def fp16_layers_of_kept_nodes(engine_info: dict[str, Any], keep: frozenset[str]) -> list[str]:
    """Engine layers made only of kept ONNX nodes that still output FP16 (inspector JSON).

    ``engine_info`` is ``IEngineInspector.get_engine_information(JSON)`` of an engine built
    with detailed profiling verbosity: each layer lists its ONNX nodes in ``Metadata``
    (``[ONNX Layer: <node>]``) and its outputs' ``Format/Datatype``. A fused layer that
    mixes kept and FP16 nodes is not reported: its boundary types come from the graph.
    """
    found = []
    for layer in engine_info.get("Layers", []):
        if not isinstance(layer, dict):
            continue
        nodes = set(_ONNX_LAYER.findall(str(layer.get("Metadata", ""))))
        if not nodes or not nodes <= keep:
            continue
        formats = [str(o.get("Format/Datatype", "")) for o in layer.get("Outputs", [])]
        if any(re.search(r"\b(FP16|Half)\b", f) for f in formats):
            found.append(str(layer.get("Name", "?")))
    return found


def layers_with_onnx_names(engine_info: dict[str, Any]) -> int:
    """How many engine layers the inspector names ONNX nodes for (0: the check saw nothing)."""
    layers = engine_info.get("Layers", [])
    return sum(
        1 for x in layers if isinstance(x, dict) and _ONNX_LAYER.search(str(x.get("Metadata", "")))
    )


def _build_engine(
    trt: Any, onnx_file: Path, cfg: PlanConfig, precision: Precision, engine_file: Path
) -> tuple[Any, dict[str, Any], int]:
    """(the engine, its inspector JSON, number of layers), the serialized engine written to
    ``engine_file`` straight from TensorRT's buffer (no ``bytes`` copy: an FP32 xxl engine
    is ~19 GB) and the parser and network freed before it is deserialized."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if precision == "fp16" else 0
    network = builder.create_network(flags)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_file)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise FailedPrecondition(f"TensorRT could not parse {onnx_file}: {errors}")
    config = builder.create_builder_config()
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # ONNX names for the inspector
    if precision == "fp32":
        config.clear_flag(trt.BuilderFlag.TF32)  # the FP32 fallback is the exact one
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(cfg.workspace_gb * (1 << 30)))
    profile = builder.create_optimization_profile()
    for name in ("input_ids", "attention_mask"):
        profile.set_shape(name, cfg.min_shape, cfg.opt_shape, cfg.max_shape)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise FailedPrecondition(f"TensorRT {precision} build failed (see the log above)")
    layers = int(network.num_layers)
    del parser, network, config, builder  # the parser's copy of the weights
    gc.collect()
    with open(engine_file, "wb") as fh:
        fh.write(serialized)  # the buffer itself (IHostMemory has the buffer protocol)
        fh.flush()
        os.fsync(fh.fileno())
    engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
    del serialized
    gc.collect()
    inspector = engine.create_engine_inspector()
    info = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    return engine, info, layers


def _run_engine(trt: Any, engine: Any, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import torch

    context = engine.create_execution_context()
    torch_types = {
        trt.int64: torch.int64,
        trt.int32: torch.int32,
        trt.float32: torch.float32,
        trt.float16: torch.float16,
    }
    stream = torch.cuda.Stream()
    # Copies, allocation and execution on one stream: a copy queued on another stream
    # (the default one) is not ordered before execute_async_v3 on this one.
    with torch.cuda.stream(stream):
        tensors = {}
        for name, array in (("input_ids", ids), ("attention_mask", mask)):
            dtype = torch_types[engine.get_tensor_dtype(name)]
            tensors[name] = torch.from_numpy(array).to("cuda", dtype=dtype).contiguous()
            context.set_input_shape(name, tuple(array.shape))
        out_shape = tuple(context.get_tensor_shape("embedding"))
        out = torch.empty(
            out_shape, dtype=torch_types[engine.get_tensor_dtype("embedding")], device="cuda"
        )
        tensors["embedding"] = out
        for name, tensor in tensors.items():
            context.set_tensor_address(name, tensor.data_ptr())
        if not context.execute_async_v3(stream.cuda_stream):
            raise FailedPrecondition("TensorRT execution failed on the probe batch")
    stream.synchronize()
    return out.float().cpu().numpy()


def _device() -> tuple[str, str]:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return torch.cuda.get_device_name(), f"{major}.{minor}"


def build_plan(
    onnx_path: Path,
    plan_path: Path,
    cfg: PlanConfig,
    probe_ids: np.ndarray,
    probe_mask: np.ndarray,
    reference: np.ndarray,
) -> PlanReport:
    """Build a plan, verify it against ``reference`` (PyTorch fp32), then write it.

    ``probe_ids``/``probe_mask`` are one padded token batch (:func:`probe_tokens`: the
    profile's maximum shape) and ``reference`` the PyTorch embeddings of it. Each
    precision of ``cfg.attempts`` is built and gated in turn (:func:`check_embeddings`);
    the first that passes is written with its ``<plan>.json``. Raises PlanParityError
    (and writes nothing) when none passes.
    """
    import onnx

    trt = _require_tensorrt()
    attempts, refused_fp32 = plan_attempts(cfg, fp32_plan_bytes(onnx_path))
    model = onnx.load(str(onnx_path))
    selection = select_fp32_nodes(model, keep_ffn_out=cfg.keep_ffn_out_fp32)
    unknown = sorted(cfg.extra_fp32_nodes - {n.name for n in model.graph.node})
    del model  # each attempt loads its own, and drops it before TensorRT parses
    if unknown:
        raise InvalidArgument(f"--extra-fp32-nodes: no such ONNX node(s) {unknown}")
    keep = frozenset(selection.all | cfg.extra_fp32_nodes)
    rejected: list[str] = []
    plan_path = Path(plan_path)
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    for precision in attempts:
        fd, name = tempfile.mkstemp(prefix=f".{plan_path.name}.", dir=plan_path.parent)
        os.close(fd)
        engine_file = Path(name)  # beside the plan: placed by a rename, never copied
        try:
            built = _attempt(trt, onnx_path, keep, cfg, precision, engine_file)
            probe = (probe_ids, probe_mask)
            cosine, failure = _gate(trt, built, keep, precision, probe, reference, cfg)
            layers, inspected = built.layers, layers_with_onnx_names(built.info)
            del built  # the engine freed before the next attempt builds its own
            gc.collect()
            if failure is not None:
                log.warning("%s plan refused: %s", precision, failure)
                rejected.append(f"{precision}: {failure}")
                continue
            if rejected:
                log.warning(
                    "%s plan written after %s: expect about twice the latency and memory "
                    "of FP16 (Triton exports gtr_encoder_plan_info{precision=%r})",
                    precision,
                    "; ".join(rejected),
                    precision,
                )
            gpu, capability = _device()
            shapes = (cfg.min_shape, cfg.opt_shape, cfg.max_shape)
            meta = PlanMeta(trt.__version__, precision, *shapes, cosine, len(keep), gpu, capability)
            place_plan(engine_file, plan_path, meta)
            return PlanReport(
                plan_path, cosine, len(keep), layers, precision, tuple(rejected), inspected
            )
        finally:
            engine_file.unlink(missing_ok=True)
    rejected.extend([refused_fp32] if refused_fp32 else [])
    raise PlanParityError(
        f"no plan written ({'; '.join(rejected)}; {len(keep)} ONNX nodes kept in FP32): "
        + MORE_FP32_HINT
    )


@dataclass
class _Built:
    engine: Any
    info: dict[str, Any]
    layers: int


def _attempt(
    trt: Any,
    onnx_path: Path,
    keep: frozenset[str],
    cfg: PlanConfig,
    precision: Precision,
    engine_file: Path,
) -> _Built:
    """One precision's engine: the graph loaded, cast (FP16), saved and dropped before
    TensorRT parses it (host memory holds one copy of the weights at a time: xxl ~19 GB)."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="gtr-plan-") as tmp:
        graph_file = Path(tmp) / "model.onnx"
        graph = onnx.load(str(onnx_path))
        if precision == "fp16":
            graph = fp16_graph(graph, set(keep), inplace=True)
        onnx.save_model(
            graph,
            str(graph_file),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="model.onnx.data",
        )
        del graph
        gc.collect()
        return _Built(*_build_engine(trt, graph_file, cfg, precision, engine_file))


def _gate(
    trt: Any,
    built: _Built,
    keep: frozenset[str],
    precision: Precision,
    probe: tuple[np.ndarray, np.ndarray],
    reference: np.ndarray,
    cfg: PlanConfig,
) -> tuple[float, str | None]:
    """(min cosine, why the engine is refused or None): the parity gate on the probe
    batch, and for FP16 the inspector's check that the FP32-kept nodes stayed FP32."""
    got = _run_engine(trt, built.engine, *probe)
    cosine, failure = check_embeddings(reference, got, cfg.min_cosine)
    if failure is None and precision == "fp16":
        demoted = fp16_layers_of_kept_nodes(built.info, keep)
        if demoted:
            failure = f"{len(demoted)} FP32-selected layers run in FP16: {demoted[:5]}"
    return cosine, failure


def probe_tokens(
    ids: np.ndarray, mask: np.ndarray, shape: tuple[int, int], pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """A token batch of exactly ``shape`` (the profile's max batch × max sequence).

    Rows are repeated to fill the batch; columns are cut or padded (mask 0) to the length.
    The probe must reach the maximum: overflow grows with sequence length.
    """
    batch, seq = shape
    rows = np.resize(np.arange(len(ids)), batch)
    out_ids = np.full((batch, seq), pad_id, dtype=np.int64)
    out_mask = np.zeros((batch, seq), dtype=np.int64)
    width = min(seq, ids.shape[1])
    out_ids[:, :width] = ids[rows, :width]
    out_mask[:, :width] = mask[rows, :width]
    return out_ids, out_mask


def build_plan_from_model(
    model_dir: Path, onnx_path: Path, plan_path: Path, cfg: PlanConfig | None = None
) -> PlanReport:
    """:func:`build_plan` with the probe batch and PyTorch reference made from ``model_dir``."""
    import torch

    from services.encoder.build.export import PROBE_TEXTS
    from services.encoder.model import TorchEmbedder

    _require_tensorrt()  # before loading a checkpoint of several GB
    embedder = TorchEmbedder(model_dir)
    cfg = cfg or PlanConfig.for_profile(embedder.profile)
    # One text long enough to fill the longest sequence (truncated there).
    texts = [*PROBE_TEXTS, " ".join(PROBE_TEXTS) * 40]
    batch = embedder.tokenize(texts, "document")
    ids, mask = probe_tokens(
        batch.input_ids, batch.attention_mask, cfg.max_shape, embedder.tokenizer_spec.pad_id
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    module = embedder.module.to(device)
    rows = []
    with torch.inference_mode():
        for i in range(0, len(ids), 8):
            chunk = [torch.from_numpy(a[i : i + 8]).to(device) for a in (ids, mask)]
            rows.append(module(*chunk).float().cpu().numpy())
    reference = np.concatenate(rows)
    # Free the PyTorch model before the build: the builder holds the FP32 ONNX graph and
    # its FP16 copy in host memory (xxl: ~19 + ~10 GB), and TensorRT the GPU; an FP32 xxl
    # model beside them would add another 19 GB (the chart's planMemory assumes it gone).
    del module, embedder, chunk
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return build_plan(onnx_path, plan_path, cfg, ids, mask, reference)
