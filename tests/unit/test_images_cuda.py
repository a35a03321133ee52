"""Issue #37 item 1: the GPU images' packages agree on one CUDA major with the Triton image.

The pins (pyproject.toml's ``gpu`` extra, the torch of gtr-retrieval-gpu.Dockerfile, the
onnxruntime-gpu of triton.Dockerfile) are checked against a recorded table of each wheel's
CUDA requirement (tests/support/wheel_cuda.json, which says where each figure was read);
the build-time check itself (deploy/docker/check_cuda.py, run in both Dockerfiles) on
package sets as the wheels declare them; and ``encoder build-plan`` / ``ensure-plan``'s own
check of the torch they run (tensorrt_build.check_cuda). Before: PyPI's torch 2.13.0 and
onnxruntime-gpu 1.31.1, both CUDA 13, beside CUDA 12 faiss-gpu and TensorRT.
"""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from services.common.errors import FailedPrecondition
from services.encoder.build.tensorrt_build import (
    NO_TRT_REASON,
    TRITON_CUDA,
    TRITON_IMAGE_TAG,
    check_cuda,
)

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
TABLE = json.loads((ROOT / "tests" / "support" / "wheel_cuda.json").read_text())
MAJOR = int(TRITON_CUDA[TRITON_IMAGE_TAG].split(".")[0])


def _check_cuda_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_cuda", DOCKER / "check_cuda.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_pins() -> dict[str, str]:
    """Every pinned GPU wheel of the images: ``name==version`` → where it is pinned."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {req: "pyproject.toml [gpu]" for req in project["optional-dependencies"]["gpu"]}
    app = (DOCKER / "gtr-retrieval-gpu.Dockerfile").read_text()
    for torch in re.findall(r'"(torch==[^"]+)"', app):
        pins[torch] = "gtr-retrieval-gpu.Dockerfile"
    triton = (DOCKER / "triton.Dockerfile").read_text()
    for ort in re.findall(r"(onnxruntime-gpu==\S+)", triton):
        pins[ort] = "triton.Dockerfile"
    return pins


def test_every_pinned_gpu_wheel_uses_the_triton_images_cuda_major() -> None:
    pins = gpu_pins()
    assert {"torch==2.13.0+cu126", "onnxruntime-gpu==1.26.0", "faiss-gpu==1.15.1"} <= set(pins)
    unknown = sorted(p for p in pins if p not in TABLE["wheels"])
    assert not unknown, f"record the CUDA of {unknown} in tests/support/wheel_cuda.json"
    wrong = {p: TABLE["wheels"][p]["cuda"] for p in pins if TABLE["wheels"][p]["cuda"] != MAJOR}
    assert not wrong, f"CUDA {MAJOR} is Triton {TRITON_IMAGE_TAG}'s; these differ: {wrong}"
    # the pins the issue found are recorded as what they are
    assert TABLE["wheels"]["torch==2.13.0"]["cuda"] == 13
    assert TABLE["wheels"]["onnxruntime-gpu==1.31.1"]["cuda"] == 13


def test_the_table_and_the_code_agree_on_tritons_cuda() -> None:
    recorded = TABLE["triton"][TRITON_IMAGE_TAG]
    assert recorded["cuda"].startswith(TRITON_CUDA[TRITON_IMAGE_TAG] + ".")
    assert all(w["source"] for w in TABLE["wheels"].values()) and TABLE["how"]


@pytest.mark.parametrize("dockerfile", ["gtr-retrieval-gpu.Dockerfile", "triton.Dockerfile"])
def test_the_build_checks_the_cuda_major(dockerfile: str) -> None:
    text = (DOCKER / dockerfile).read_text()
    assert re.search(rf"^ARG CUDA_MAJOR={MAJOR}$", text, re.M), dockerfile
    assert re.search(r'check_cuda\.py --major "\$\{CUDA_MAJOR\}"', text), dockerfile
    assert "COPY deploy/docker/check_cuda.py" in text
    if dockerfile.startswith("gtr-retrieval"):
        assert "--torch" in text and "download.pytorch.org/whl/cu126" in text


# The packages each torch 2.13.0 build brings (their Requires-Dist, tests/support/wheel_cuda.json)
PYPI_TORCH = [
    ("torch", "2.13.0"),
    ("cuda-toolkit", "13.0.3"),
    ("nvidia-cudnn-cu13", "9.20.0.48"),
    ("nvidia-nccl-cu13", "2.29.7"),
    ("faiss-gpu", "1.15.1"),
    ("nvidia-cuda-runtime-cu12", "12.6.77"),
    ("tensorrt-cu12", "10.7.0"),
]
CU126_TORCH = [
    ("torch", "2.13.0+cu126"),
    ("nvidia-cudnn-cu12", "9.10.2.21"),
    ("nvidia_cublas_cu12", "12.6.4.1"),
    ("faiss-gpu", "1.15.1"),
    ("onnxruntime-gpu", "1.26.0"),
    ("tensorrt-cu12", "10.7.0"),
]


def test_the_build_time_check_refuses_a_cuda_13_torch_beside_cuda_12() -> None:
    check = _check_cuda_script()
    found = check.cuda_majors(PYPI_TORCH)
    assert check.problems(found, MAJOR) == [
        "cuda-toolkit 13.0.3: CUDA 13",
        "nvidia-cudnn-cu13 9.20.0.48: CUDA 13",
        "nvidia-nccl-cu13 2.29.7: CUDA 13",
    ]
    fixed = check.cuda_majors(CU126_TORCH)
    assert fixed["torch 2.13.0+cu126"] == 12 and fixed["nvidia-cublas-cu12 12.6.4.1"] == 12
    assert check.problems(fixed, MAJOR) == []
    assert check.cuda_majors([("torch", "2.13.0+cu130"), ("nvidia-cuda-runtime", "13.0.96")]) == {
        "torch 2.13.0+cu130": 13,
        "nvidia-cuda-runtime 13.0.96": 13,
    }


def test_the_build_time_check_reads_installed_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    """On this machine (CPU torch, no CUDA wheels) nothing names a CUDA major; with
    --torch the CPU torch is refused, as a CPU torch in the GPU image would be."""
    check = _check_cuda_script()
    assert check.main(["--major", str(MAJOR)]) == 0
    assert check.main(["--major", str(MAJOR), "--torch"]) == 1
    assert "torch.version.cuda None" in capsys.readouterr().err


def test_the_plan_build_checks_the_torch_it_runs() -> None:
    check_cuda("12.6", True)
    with pytest.raises(FailedPrecondition, match=r"CUDA 13\.0, and Triton 24\.12-py3 runs CUDA"):
        check_cuda("13.0", True)
    with pytest.raises(FailedPrecondition, match="R560") as no_gpu:
        check_cuda("12.6", False)
    assert NO_TRT_REASON in no_gpu.value.message
    with pytest.raises(FailedPrecondition, match="CPU build"):
        check_cuda(None, False)
