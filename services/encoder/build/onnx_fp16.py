"""Which nodes of an encoder's ONNX graph stay FP32 in an FP16 engine, and the FP16 cast.

T5's activations exceed FP16's range in places (see :mod:`.tensorrt_build`): its RMSNorms
(and BERT's LayerNorms), the residual adds that feed them, the FFN output projection
``wo`` and everything after the last norm are kept FP32 (:func:`select_fp32_nodes`);
the rest of the graph is cast to FP16 by ONNX Runtime's float16 converter with those
nodes as its block list (:func:`fp16_graph`). Pure ``onnx``/``onnxruntime``: runs (and is
tested) anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


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
        return tensor in self.constants or (
            node is not None and node.op_type == "Identity" and node.input[0] in self.constants
        )

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
        n.name
        for n in graph.nodes
        if n.op_type == "Add"
        and len(n.input) == 2
        and not any(graph.is_constant(i) for i in n.input)
        and n.output[0] in norm_starts
    }
    ffn = {
        n.name
        for n in graph.nodes
        if keep_ffn_out and n.op_type == "MatMul" and re.search(r"/wo(/|$)", n.name)
    }
    tail = _downstream(graph, last_norm) - norms if last_norm else set()
    return Fp32Selection(frozenset(norms), frozenset(residual), frozenset(ffn), frozenset(tail))


_SET_ASIDE = 1 << 20  # initializers above this many bytes are weights, not shape tensors


def _infer_value_types(model: Any) -> None:
    """Fill ``model.graph.value_info`` by ONNX shape inference, in place, at any model size.

    ``infer_shapes`` serialises the model, which fails above protobuf's 2 GB (GTR xl/xxl):
    the weights' bytes are set aside meanwhile (small initializers, the shape tensors
    inference reads, stay).
    """
    import onnx

    stash = [(i, i.raw_data) for i in model.graph.initializer if len(i.raw_data) > _SET_ASIDE]
    for init, _ in stash:
        init.ClearField("raw_data")
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    finally:
        for init, data in stash:
            init.raw_data = data
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)


def _boundary_free(model: Any, keep: set[str]) -> Any:
    """``model`` with value types inferred, minus those of tensors inside the FP32 region.

    The float16 converter turns every typed float tensor into FP16 and wraps each kept
    node in Cast(→fp32) … Cast(→fp16); between two kept nodes that round trip through
    FP16 is exactly the overflow the block list is there to avoid. A tensor without a
    value type is left alone, so only the tensors that cross the region's boundary keep
    theirs (and get their Cast).
    """
    _infer_value_types(model)
    graph = _Graph(model)
    # Constants (and Identity copies of initializers) used only by kept nodes stay FP32 too.
    for node in graph.nodes:
        users = graph.next_nodes(node)
        if (
            node.op_type in {"Constant", "Identity"}
            and users
            and all(u.name in keep for u in users)
        ):
            keep.add(node.name)
    inside = [
        v
        for v in model.graph.value_info
        if (p := graph.producer.get(v.name)) is not None
        and p.name in keep
        and all(c.name in keep for c in graph.consumers.get(v.name, []))
    ]
    for value in inside:
        model.graph.value_info.remove(value)
    return model


def fp16_graph(model: Any, keep_fp32: Iterable[str], *, inplace: bool = False) -> Any:
    """``model`` cast to FP16 except the nodes ``keep_fp32`` (inputs and outputs keep their types).

    ONNX Runtime's float16 converter (``onnxruntime.transformers.float16``, the maintained
    fork of onnxconverter-common's) with ``keep_fp32`` as its node block list. Initializers
    used only by kept nodes stay FP32; others are clamped to FP16's range. ``inplace``
    converts ``model`` itself (no copy of an xxl model's 19 GB).
    """
    import copy

    from onnxruntime.transformers import float16

    keep = set(keep_fp32)
    prepared = _boundary_free(model if inplace else copy.deepcopy(model), keep)
    return float16.convert_float_to_float16(
        prepared, keep_io_types=True, node_block_list=sorted(keep), disable_shape_infer=True
    )
