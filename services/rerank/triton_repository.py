"""Write the ``rerank`` model (Python backend) into a Triton model repository.

``<repo>/rerank/config.pbtxt`` is built as Triton's own ``ModelConfig`` protobuf and
``<repo>/rerank/1/model.py`` is a copy of ``triton_models/rerank.py``, next to the models'
shared ``model_errors.py``. The checkpoint is referenced by absolute path (parameter
``checkpoint``; empty = untrained default head).
``kind="gpu"`` makes GPU instances (the model moves to the instance's device), so one
Triton on a GPU host serves the encoder's ``embed`` and this ``rerank`` side by side.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from services.encoder.repository import MODEL_ERRORS

MODEL_NAME = "rerank"
MODEL_SOURCE = Path(__file__).resolve().parent / "triton_models" / "rerank.py"


@dataclass(frozen=True)
class TritonRerankConfig:
    checkpoint: Path | None = None
    kind: Literal["cpu", "gpu"] = "cpu"  # gpu: KIND_GPU instances, the model runs on cuda:<id>
    instances: int = 1
    threads: int = 2  # torch threads per instance
    batch_size: int = 16  # pairs per forward pass


def rerank_model_config(cfg: TritonRerankConfig) -> mc.ModelConfig:
    config = mc.ModelConfig(name=MODEL_NAME, backend="python", max_batch_size=0)
    config.input.add(name="QUERY", data_type=mc.TYPE_STRING, dims=[1])
    config.input.add(name="DOCS", data_type=mc.TYPE_STRING, dims=[-1])
    config.output.add(name="SCORES", data_type=mc.TYPE_FP32, dims=[-1])
    kind = mc.ModelInstanceGroup.KIND_GPU if cfg.kind == "gpu" else mc.ModelInstanceGroup.KIND_CPU
    config.instance_group.add(count=cfg.instances, kind=kind)
    params = {
        "checkpoint": str(Path(cfg.checkpoint).resolve()) if cfg.checkpoint else "",
        "threads": str(cfg.threads),
        "batch_size": str(cfg.batch_size),
    }
    for key, value in params.items():
        config.parameters[key].string_value = value
    return config


def write_rerank_model(repo: Path, cfg: TritonRerankConfig) -> Path:
    """Write ``rerank/config.pbtxt``, ``rerank/1/model.py`` and its ``model_errors.py``
    under ``repo``; return the model's dir."""
    root = Path(repo) / MODEL_NAME
    (root / "1").mkdir(parents=True, exist_ok=True)
    (root / "config.pbtxt").write_text(text_format.MessageToString(rerank_model_config(cfg)))
    shutil.copyfile(MODEL_SOURCE, root / "1" / "model.py")
    shutil.copyfile(MODEL_ERRORS, root / "1" / "model_errors.py")
    return root
