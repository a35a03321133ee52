"""TensorRT FP16 plan for the GTR encoder, with T5's overflow-prone layers kept in FP32.

T5 was trained in bfloat16; its activations exceed FP16's range (65504) in places, and
a naive FP16 engine returns garbage or NaN (TensorRT issue 3206; Hugging Face keeps
``wo`` in fp32 for the same reason). The remedy here:

* find, in the ONNX graph, the RMSNorm pattern of T5 (``Pow(x, 2) → ReduceMean → Add(eps)
  → Sqrt → Div/Reciprocal → Mul(x, ·) → Mul(weight, ·)``; also ONNX ``LayerNormalization``
  and its decomposed form for BERT), the residual adds that feed those norms, the FFN
  output projection ``wo``, and everything after the last norm (pooling, dense,
  normalise);
* pin the matching TensorRT layers to FP32 (``layer.precision`` and output types) with
  ``BuilderFlag.OBEY_PRECISION_CONSTRAINTS``;
* build, run a probe batch, compare with PyTorch fp32, and *refuse to write* a plan whose
  cosine is below 0.999 on any row.

The graph analysis is pure ``onnx`` and runs (and is tested) anywhere; ``tensorrt`` and
CUDA are imported only inside :func:`build_plan`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import FailedPrecondition
from services.encoder.profiles import ModelProfile

PLAN_MIN_COSINE = 0.999
NO_TRT_REASON = "no GPU/TensorRT on this machine"


@dataclass(frozen=True)
class Fp32Selection:
    """ONNX node names to keep in FP32, by reason (for the build log and the tests)."""

    norms: frozenset[str]
    residual_adds: frozenset[str]
    ffn_out: frozenset[str]
    tail: frozenset[str]

    @property
    def all(self) -> frozenset[str]:
        return self.norms | self.residual_adds | self.ffn_out | self.tail


class _Graph:
    """Producer/consumer maps over an ONNX graph (nodes are topologically sorted)."""

    def __init__(self, model: Any) -> None:
        self.nodes = list(model.graph.node)
        self.constants = {i.name for i in model.graph.initializer}
        self.producer: dict[str, Any] = {}
        self.consumers: dict[str, list[Any]] = {}
        for node in self.nodes:
            for out in node.output:
                self.producer[out] = node
                if node.op_type == "Constant":
                    self.constants.add(out)
            for inp in node.input:
                self.consumers.setdefault(inp, []).append(node)

    def is_constant(self, tensor: str) -> bool:
        node = self.producer.get(tensor)
        return tensor in self.constants or (node is not None and node.op_type == "Identity"
                                            and node.input[0] in self.constants)  # fmt: skip

    def next_nodes(self, node: Any) -> list[Any]:
        return [c for out in node.output for c in self.consumers.get(out, [])]

    def constant_value(self, tensor: str, model: Any) -> float | None:
        from onnx import numpy_helper

        for init in model.graph.initializer:
            if init.name == tensor:
                return float(numpy_helper.to_array(init).reshape(-1)[0])
        node = self.producer.get(tensor)
        if node is not None and node.op_type == "Constant":
            return float(numpy_helper.to_array(node.attribute[0].t).reshape(-1)[0])
        return None


_NORM_OPS = {"Pow", "ReduceMean", "Add", "Sqrt", "Reciprocal", "Div", "Mul", "Cast", "Sub"}


def _rms_norm(graph: _Graph, pow_node: Any) -> list[Any]:
    """Nodes of one norm, from its ``Pow`` to the ``Mul`` by the weight (bias Add for LN)."""
    members = [pow_node]
    source = graph.producer.get(pow_node.input[0])
    while source is not None and source.op_type in {"Cast", "Sub"}:  # x.float(), x - mean
        members.append(source)
        if source.op_type == "Sub":
            mean = graph.producer.get(source.input[1])
            if mean is not None and mean.op_type == "ReduceMean":
                members.append(mean)
            break
        source = graph.producer.get(source.input[0])
    frontier, seen = [pow_node], {pow_node.name}
    while frontier:
        node = frontier.pop()
        for nxt in graph.next_nodes(node):
            if nxt.name in seen or nxt.op_type not in _NORM_OPS:
                continue
            seen.add(nxt.name)
            members.append(nxt)
            weighted = nxt.op_type == "Mul" and any(graph.is_constant(i) for i in nxt.input)
            if not weighted:
                frontier.append(nxt)
    # Also the normalised input's Mul(x, rsqrt) whose x comes from outside the walk.
    return members


def _downstream(graph: _Graph, start: Iterable[Any]) -> set[str]:
    seen: set[str] = set()
    stack = list(start)
    while stack:
        node = stack.pop()
        for nxt in graph.next_nodes(node):
            if nxt.name not in seen:
                seen.add(nxt.name)
                stack.append(nxt)
    return seen


def select_fp32_nodes(model: Any, *, keep_ffn_out: bool = True) -> Fp32Selection:
    """Which ONNX nodes must stay FP32 in an FP16 engine (see the module docstring)."""
    graph = _Graph(model)
    norms: set[str] = set()
    norm_starts: set[str] = set()  # tensors whose consumer starts a norm
    last_norm: list[Any] = []
    for node in graph.nodes:
        if node.op_type == "LayerNormalization":
            norms.add(node.name)
            norm_starts.add(node.input[0])
            last_norm = [node]
        elif node.op_type == "Pow" and graph.constant_value(node.input[1], model) == 2.0:
            members = _rms_norm(graph, node)
            if not any(m.op_type == "ReduceMean" for m in members):
                continue  # a square that is not a norm
            norms.update(m.name for m in members)
            entry = node
            while (src := graph.producer.get(entry.input[0])) is not None and src.op_type == "Cast":
                entry = src
            norm_starts.add(entry.input[0])
            if src is not None and src.op_type == "Sub":
                norm_starts.add(src.input[0])
            last_norm = members
    residual = {
        n.name for n in graph.nodes
        if n.op_type == "Add" and len(n.input) == 2
        and not any(graph.is_constant(i) for i in n.input)
        and n.output[0] in norm_starts
    }  # fmt: skip
    ffn = {
        n.name for n in graph.nodes
        if keep_ffn_out and n.op_type == "MatMul" and re.search(r"/wo(/|$)", n.name)
    }  # fmt: skip
    tail = _downstream(graph, last_norm) - norms if last_norm else set()
    return Fp32Selection(frozenset(norms), frozenset(residual), frozenset(ffn), frozenset(tail))


def layer_matches(layer_name: str, node_names: frozenset[str]) -> bool:
    """Does a TensorRT layer come from one of ``node_names``?

    The ONNX parser names a layer after its node, and helper layers ``<node>_<suffix>``;
    ``/x/Add_1`` is another node than ``/x/Add``, so a purely numeric suffix never matches.
    """
    if layer_name in node_names:
        return True
    head, sep, suffix = layer_name.rpartition("_")
    while sep:
        if head in node_names and not suffix.isdigit():
            return True
        head, sep, suffix = head.rpartition("_")
    return False


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

    @classmethod
    def for_profile(cls, profile: ModelProfile) -> PlanConfig:
        # opt: batch 8 of 128-token inputs, the GTR paper's latency point, between the
        # typical query (32) and document (256) lengths of the profile.
        return cls(opt_shape=(min(8, profile.max_batch), 128),
                   max_shape=(profile.max_batch, profile.document_max_len))  # fmt: skip


@dataclass(frozen=True)
class PlanReport:
    plan_path: Path | None
    min_cosine: float
    fp32_layers: int
    total_layers: int


class PlanParityError(FailedPrecondition):
    """The FP16 engine disagrees with PyTorch; no plan was written."""


def _require_tensorrt() -> Any:
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise FailedPrecondition(f"{NO_TRT_REASON} (import tensorrt failed: {exc})") from None
    import torch

    if not torch.cuda.is_available():
        raise FailedPrecondition(NO_TRT_REASON + " (torch.cuda.is_available() is False)")
    return trt


def _run_engine(trt: Any, engine_bytes: bytes, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import torch

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(engine_bytes)
    context = engine.create_execution_context()
    torch_types = {trt.int64: torch.int64, trt.int32: torch.int32, trt.float32: torch.float32,
                   trt.float16: torch.float16}  # fmt: skip
    tensors = {}
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        dtype = torch_types[engine.get_tensor_dtype(name)]
        tensors[name] = torch.from_numpy(array).to("cuda", dtype=dtype).contiguous()
        context.set_input_shape(name, tuple(array.shape))
    out_shape = tuple(context.get_tensor_shape("embedding"))
    out = torch.empty(out_shape, dtype=torch_types[engine.get_tensor_dtype("embedding")],
                      device="cuda")  # fmt: skip
    tensors["embedding"] = out
    for name, tensor in tensors.items():
        context.set_tensor_address(name, tensor.data_ptr())
    stream = torch.cuda.Stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise FailedPrecondition("TensorRT execution failed on the probe batch")
    stream.synchronize()
    return out.float().cpu().numpy()


def build_plan(
    onnx_path: Path,
    plan_path: Path,
    cfg: PlanConfig,
    probe_ids: np.ndarray,
    probe_mask: np.ndarray,
    reference: np.ndarray,
) -> PlanReport:
    """Build an FP16 plan, verify it against ``reference`` (PyTorch fp32), then write it.

    ``probe_ids``/``probe_mask`` are one padded token batch and ``reference`` the PyTorch
    embeddings of it. Raises PlanParityError (and writes nothing) below ``cfg.min_cosine``.
    """
    import onnx

    from services.encoder.export import row_cosines

    trt = _require_tensorrt()
    selection = select_fp32_nodes(
        onnx.load(str(onnx_path), load_external_data=False), keep_ffn_out=cfg.keep_ffn_out_fp32
    )
    keep = selection.all | cfg.extra_fp32_nodes
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise FailedPrecondition(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(cfg.workspace_gb * (1 << 30)))
    profile = builder.create_optimization_profile()
    for name in ("input_ids", "attention_mask"):
        profile.set_shape(name, cfg.min_shape, cfg.opt_shape, cfg.max_shape)
    config.add_optimization_profile(profile)
    pinned = 0
    float_types = {trt.float32, trt.float16}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        outputs = [layer.get_output(j) for j in range(layer.num_outputs)]
        if not layer_matches(layer.name, keep) or not all(o.dtype in float_types for o in outputs):
            continue
        layer.precision = trt.float32
        for j in range(layer.num_outputs):
            layer.set_output_type(j, trt.float32)
        pinned += 1
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise FailedPrecondition("TensorRT build failed (see the log above)")
    engine_bytes = bytes(serialized)
    got = _run_engine(trt, engine_bytes, probe_ids, probe_mask)
    cosine = min(row_cosines(reference, got))
    if not np.isfinite(got).all() or cosine < cfg.min_cosine:
        raise PlanParityError(
            f"FP16 plan rejected: min cosine vs PyTorch {cosine:.5f} < {cfg.min_cosine} "
            f"({pinned} layers pinned to FP32); pin more layers with extra_fp32_nodes"
        )
    plan_path = Path(plan_path)
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = plan_path.with_suffix(".plan.tmp")
    tmp.write_bytes(engine_bytes)
    os.replace(tmp, plan_path)
    return PlanReport(plan_path, cosine, pinned, network.num_layers)


def build_plan_from_model(
    model_dir: Path, onnx_path: Path, plan_path: Path, cfg: PlanConfig | None = None
) -> PlanReport:
    """:func:`build_plan` with the probe batch and PyTorch reference made from ``model_dir``."""
    from services.encoder.export import PROBE_TEXTS
    from services.encoder.model import TorchEmbedder

    embedder = TorchEmbedder(model_dir)
    batch = embedder.tokenize(list(PROBE_TEXTS), "document")
    reference = embedder.run(batch)
    cfg = cfg or PlanConfig.for_profile(embedder.profile)
    return build_plan(onnx_path, plan_path, cfg, batch.input_ids, batch.attention_mask, reference)
