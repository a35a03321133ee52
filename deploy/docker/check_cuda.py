"""Fail an image build whose Python packages do not all use one CUDA major.

    python check_cuda.py --major 12 [--path DIR] [--torch]

Run in the build stage of deploy/docker/gtr-retrieval-gpu.Dockerfile (the venv, with
``--torch``) and triton.Dockerfile (``--path`` the Python-backend packages): the GPU
image's torch, faiss-gpu, TensorRT and onnxruntime-gpu must use the CUDA major of the
Triton image (24.12-py3: CUDA 12.6; services/encoder/build/tensorrt_build.py
``TRITON_CUDA``), which the nodes' driver is chosen for (docs/deploy.md, checklist row
1). Issue #37 item 1: PyPI's torch 2.13.0 is the CUDA 13 build (it requires
cuda-toolkit 13.0.3 and nvidia-cudnn-cu13) and onnxruntime-gpu 1.31.1 too (its ``cuda``
extra: nvidia-cuda-runtime ~=13.0); on an R535-R570 driver CUDA 13 sees no GPU.

What says a distribution's CUDA major, from its installed metadata: a ``-cuNN`` name
suffix (nvidia-cublas-cu12, tensorrt-cu12, nvidia-cudnn-cu13), the version of the CUDA
packages that carry it (cuda-toolkit, nvidia-cuda-runtime, nvidia-cuda-nvrtc), a torch
local version (``+cu126``), and with ``--torch`` torch's own ``torch.version.cuda``.
Standard library only; tested in tests/unit/test_images_cuda.py.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from collections.abc import Iterable

_SUFFIX = re.compile(r"[-_]cu(\d+)$")
_BY_VERSION = {"cuda-toolkit", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc"}  # version = CUDA's
_TORCH_LOCAL = re.compile(r"\+cu(\d+?)(\d)$")  # +cu126: CUDA 12.6; +cu130: 13.0


def _major(text: str) -> int:
    return int(text.split(".")[0])


def cuda_majors(dists: Iterable[tuple[str, str]]) -> dict[str, int]:
    """``{"name version": CUDA major}`` of the distributions (name, version) that say one."""
    found: dict[str, int] = {}
    for name, version in dists:
        key = name.lower().replace("_", "-")
        if m := _SUFFIX.search(key):
            found[f"{key} {version}"] = int(m.group(1))
        elif key in _BY_VERSION:
            found[f"{key} {version}"] = _major(version)
        elif key == "torch" and (m := _TORCH_LOCAL.search(version)):
            found[f"{key} {version}"] = int(m.group(1))
    return found


def problems(found: dict[str, int], major: int) -> list[str]:
    return [f"{what}: CUDA {got}" for what, got in sorted(found.items()) if got != major]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--major", type=int, required=True, help="the Triton image's CUDA major")
    parser.add_argument("--path", action="append", help="site-packages to read (default: sys.path)")
    parser.add_argument("--torch", action="store_true", help="also torch.version.cuda")
    args = parser.parse_args(argv)
    dists = md.distributions(path=args.path) if args.path else md.distributions()
    found = cuda_majors((d.metadata["Name"], d.version) for d in dists)
    if args.torch:
        import torch  # only where the image has it (the application image)

        cuda = torch.version.cuda
        found[f"torch.version.cuda {cuda}"] = _major(cuda) if cuda else 0
    wrong = problems(found, args.major)
    for line in wrong:
        print(f"check_cuda: {line}, the Triton image's is CUDA {args.major}", file=sys.stderr)
    print(f"check_cuda: {len(found)} packages name a CUDA major; {len(wrong)} differ")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
