"""Published GTR checkpoints are saved in float16: they must still load (and export) in FP32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from services.encoder.build.export import check_parity, export_onnx
from services.encoder.model import load_dual_encoder
from tests.encoder_fixtures import encoder_base, ensure_tiny_t5


@pytest.fixture(scope="module")
def fp16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GTR with its T5 and Dense weights saved in float16, as gtr-t5-* are."""
    from safetensors.torch import load_file, save_file

    src = ensure_tiny_t5(encoder_base(tmp_path_factory))
    dst = tmp_path_factory.mktemp("fp16") / "tiny-gtr-fp16"
    shutil.copytree(src, dst)
    for weights in (dst / "model.safetensors", dst / "2_Dense" / "model.safetensors"):
        state = {k: v.half().contiguous() for k, v in load_file(str(weights)).items()}
        save_file(state, str(weights), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float16"  # what the published GTR configs say
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_fp16_saved_checkpoint_loads_in_fp32(fp16_dir: Path) -> None:
    module = load_dual_encoder(fp16_dir)
    dtypes = {p.dtype for p in module.parameters()}
    assert dtypes == {torch.float32}
    ids = torch.tensor([[5, 6, 7, 1], [8, 9, 1, 0]])
    with torch.inference_mode():  # the FP32 Dense after an FP16 backbone raised here
        out = module(ids, (ids != 0).long())
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    np.testing.assert_allclose(out.norm(dim=-1).numpy(), 1.0, rtol=1e-5)


def test_fp16_saved_checkpoint_exports_with_fp32_parity(fp16_dir: Path, tmp_path: Path) -> None:
    onnx_path = tmp_path / "model.onnx"
    export_onnx(fp16_dir, onnx_path)
    report = check_parity(fp16_dir, onnx_path)
    assert report.passed, report.summary()
