"""The generated ``rerank/config.pbtxt`` parses with Triton's own schema."""

from __future__ import annotations

from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from services.encoder.repository import read_config
from services.rerank.triton_repository import TritonRerankConfig, write_rerank_model


def test_config_parses_and_declares_the_contract(tmp_path: Path) -> None:
    root = write_rerank_model(tmp_path, TritonRerankConfig(checkpoint=tmp_path / "ckpt",
                                                           instances=2, threads=1))  # fmt: skip
    config = read_config(root / "config.pbtxt")
    assert (config.name, config.backend, config.max_batch_size) == ("rerank", "python", 0)
    inputs = {t.name: (t.data_type, list(t.dims)) for t in config.input}
    outputs = {t.name: (t.data_type, list(t.dims)) for t in config.output}
    assert inputs == {"QUERY": (mc.TYPE_STRING, [1]), "DOCS": (mc.TYPE_STRING, [-1])}
    assert outputs == {"SCORES": (mc.TYPE_FP32, [-1])}
    assert config.instance_group[0].count == 2
    assert config.parameters["checkpoint"].string_value == str((tmp_path / "ckpt").resolve())
    assert (root / "1" / "model.py").read_text().startswith('"""Triton Python-backend model')


def test_gpu_kind_makes_gpu_instances(tmp_path: Path) -> None:
    root = write_rerank_model(tmp_path, TritonRerankConfig(kind="gpu"))
    config = read_config(root / "config.pbtxt")
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    assert config.parameters["checkpoint"].string_value == ""  # untrained default head
