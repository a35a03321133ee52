"""The `cpu` and `gpu` extras: one owner per module, pinned, and TensorRT = the chart's Triton.

faiss-cpu and faiss-gpu (and its -cuXY builds) all install the module ``faiss``;
onnxruntime and onnxruntime-gpu both install ``onnxruntime``. Installing two of one
group makes the last writer win, file by file. The declared sets are checked here
always; the resolution with pip (``install --dry-run --report``, dependencies included)
where PyPI is reachable.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from services.encoder.build.tensorrt_build import (
    TENSORRT_VERSION,
    TRITON_IMAGE_TAG,
    TRITON_TENSORRT,
)

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BASE: list[str] = PYPROJECT["project"]["dependencies"]
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]

# distributions that write the same top-level module
MODULE_OWNERS = {
    "faiss": re.compile(r"^faiss-(cpu|gpu)(-cu\d+)?(-cuvs)?$|^faiss-gpu-cuvs$"),
    "onnxruntime": re.compile(r"^onnxruntime(-gpu)?$"),
    "tensorrt": re.compile(r"^tensorrt(-cu\d+)?$"),
}


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _clashes(names: list[str]) -> dict[str, list[str]]:
    found = {m: sorted({n for n in names if rx.match(n)}) for m, rx in MODULE_OWNERS.items()}
    return {m: owners for m, owners in found.items() if len(owners) > 1}


def test_the_owner_patterns_recognise_the_clash_they_guard_against() -> None:
    assert _clashes(["faiss-cpu", "faiss-gpu-cu12", "onnxruntime", "onnxruntime-gpu"]) == {
        "faiss": ["faiss-cpu", "faiss-gpu-cu12"],
        "onnxruntime": ["onnxruntime", "onnxruntime-gpu"],
    }


def test_base_dependencies_own_neither_faiss_nor_onnxruntime() -> None:
    owned = [_name(r) for r in BASE if any(rx.match(_name(r)) for rx in MODULE_OWNERS.values())]
    assert owned == [], "these belong in the cpu or gpu extra"


@pytest.mark.parametrize("flavor", ["cpu", "gpu"])
def test_each_flavour_installs_one_owner_per_module(flavor: str) -> None:
    names = [_name(r) for r in BASE + EXTRAS[flavor] + EXTRAS["dev"]]
    assert _clashes(names) == {}
    present = {m for m, rx in MODULE_OWNERS.items() if any(rx.match(n) for n in names)}
    assert {"faiss", "onnxruntime"} <= present


@pytest.mark.parametrize("flavor", ["cpu", "gpu"])
def test_flavour_extras_are_pinned(flavor: str) -> None:
    assert all("==" in r for r in EXTRAS[flavor]), EXTRAS[flavor]


# The TensorRT release inside NVIDIA's Triton images, from NVIDIA's Triton release notes
# ("Contents of the Triton Inference Server container"; 24.12: TensorRT 10.7.0.23). Written
# here, not imported: it is what the code's own table must agree with.
NGC_TRITON_TENSORRT = {"24.12-py3": "10.7.0"}


def test_gpu_extra_pins_the_tensorrt_of_the_charts_triton_image() -> None:
    """The chart's GPU Triton image is built FROM deploy/images.env's TRITON_BASE; the
    code (plan build gate) and the gpu extra must name the TensorRT that image ships."""
    images = (ROOT / "deploy/images.env").read_text()
    base = re.search(r"^TRITON_BASE=nvcr\.io/nvidia/tritonserver:(\S+)$", images, re.M)
    assert base, "TRITON_BASE in deploy/images.env"
    tag = base.group(1)
    assert tag == TRITON_IMAGE_TAG
    assert tag in NGC_TRITON_TENSORRT, (
        f"add the TensorRT of tritonserver:{tag} (NVIDIA's release notes) to this test"
    )
    assert TENSORRT_VERSION == TRITON_TENSORRT[tag] == NGC_TRITON_TENSORRT[tag]
    tensorrt = [r for r in EXTRAS["gpu"] if MODULE_OWNERS["tensorrt"].match(_name(r))]
    assert tensorrt == [f"tensorrt-cu12=={NGC_TRITON_TENSORRT[tag]}"]


def _dry_run(requirements: list[str], tmp_path: Path) -> list[str]:
    """Names pip would install for ``requirements`` (with dependencies); skip if offline."""
    report = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--only-binary=:all:",
        "--quiet",
        "--disable-pip-version-check",
        "--report",
        str(report),
        *requirements,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    except subprocess.TimeoutExpired:
        pytest.skip("pip could not resolve within 180 s (package index slow or unreachable)")
    if done.returncode != 0:
        out = done.stdout + done.stderr
        if "ResolutionImpossible" in out or "conflicting dependencies" in out:
            pytest.fail(f"the requirements conflict:\n{out[-2000:]}")
        last = [line for line in out.splitlines() if line.startswith("ERROR")][-1:]
        pytest.skip(f"pip could not reach a package index: {last or out[-300:]}")
    return [_name(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]]


def _pins(names: set[str]) -> list[str]:
    return [r for r in BASE if _name(r) in names]


@pytest.mark.parametrize("flavor", ["cpu", "gpu"])
@pytest.mark.slow
def test_flavour_resolves_without_a_second_owner(flavor: str, tmp_path: Path) -> None:
    # The flavour's packages with the base pins they share dependencies with. TensorRT
    # 10.7.0 is left out: on PyPI it is an sdist that fetches its wheel from NVIDIA's own
    # index at build time (its pin is checked above). torch, and what needs it, are left
    # out: resolving them would fetch a CUDA build's metadata.
    requirements = [r for r in EXTRAS[flavor] if not r.startswith("tensorrt")]
    requirements += _pins({"numpy", "protobuf", "onnx", "packaging"})
    names = _dry_run(requirements, tmp_path)
    assert _clashes(names) == {}
    assert "torch" not in names
    other = "gpu" if flavor == "cpu" else "cpu"
    assert not {_name(r) for r in EXTRAS[other]} & set(names)
