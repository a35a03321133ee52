"""A TensorRT plan on disk: its ``<plan>.json`` (what built it, which shapes it covers,
its digest) and the atomic write of both. A plan only loads in the TensorRT release that
built it (Triton rejects others, triton-inference-server issue 7613): the json records
it, and :meth:`PlanMeta.check_tensorrt` refuses a mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from services.common.errors import FailedPrecondition

Precision = Literal["fp16", "fp32"]


def tensorrt_release(version: str) -> str:
    """``major.minor.patch`` of a TensorRT version string (plans are tied to it)."""
    return ".".join(version.split(".")[:3])


class PlanVersionMismatch(FailedPrecondition):
    """A plan built by another TensorRT release than the one that would load it."""


def plan_meta_path(plan_path: Path) -> Path:
    return Path(plan_path).with_name(Path(plan_path).name + ".json")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_temp(beside: Path, data: bytes) -> Path:
    """``data`` in a new file of a unique name beside ``beside`` (flushed to disk)."""
    fd, name = tempfile.mkstemp(prefix=f".{beside.name}.", suffix=".tmp", dir=beside.parent)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return Path(name)


def write_plan(plan_path: Path, engine: bytes, meta: PlanMeta) -> PlanMeta:
    """Write ``engine`` at ``plan_path`` with its ``<plan>.json`` (:func:`place_plan`)."""
    plan_path = Path(plan_path)
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    return place_plan(_write_temp(plan_path, engine), plan_path, meta)


def place_plan(engine_file: Path, plan_path: Path, meta: PlanMeta) -> PlanMeta:
    """Move ``engine_file`` (written beside ``plan_path``, same file system) to
    ``plan_path`` with its ``<plan>.json`` (recording its sha256, read from the file in
    chunks: an FP32 xxl plan is ~19 GB, never held in memory twice).

    Several builders may share a cache (the chart's init containers, one per pod): each
    writes under temp names of its own, the json first and the plan renamed last, so a
    reader that finds the plan finds a json; a json of another builder's plan (two
    builders interleaving) is caught by the digest, which every read checks
    (:func:`services.encoder.build.plan_cache.check_plan`).
    """
    plan_path = Path(plan_path)
    meta = replace(meta, plan_sha256=file_sha256(engine_file))
    meta_path = plan_meta_path(plan_path)
    tmp_meta = _write_temp(meta_path, (json.dumps(asdict(meta), indent=2) + "\n").encode())
    try:
        os.replace(tmp_meta, meta_path)
        os.replace(engine_file, plan_path)
    finally:
        for tmp in (Path(engine_file), tmp_meta):
            tmp.unlink(missing_ok=True)
    return meta


@dataclass(frozen=True)
class PlanMeta:
    """``<plan>.json``: what built the plan and which shapes it covers."""

    tensorrt_version: str
    precision: Precision
    min_shape: tuple[int, int]
    opt_shape: tuple[int, int]
    max_shape: tuple[int, int]
    min_cosine: float
    fp32_nodes: int
    gpu: str = "unknown"
    compute_capability: str = "unknown"
    plan_sha256: str = ""  # of the plan file this describes ("" in plans of older builds)

    def write(self, plan_path: Path) -> None:
        plan_meta_path(plan_path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, plan_path: Path) -> PlanMeta:
        path = plan_meta_path(plan_path)
        if not path.exists():
            raise FailedPrecondition(
                f"{plan_path} has no {path.name}: build plans with `gtr-retrieval encoder "
                "build-plan`, which records the TensorRT version and shapes Triton needs"
            )
        raw = json.loads(path.read_text())
        for key in ("min_shape", "opt_shape", "max_shape"):
            raw[key] = tuple(int(v) for v in raw[key])
        return cls(**raw)

    def check_tensorrt(self, version: str, loader: str) -> None:
        """PlanVersionMismatch unless ``version`` (the loader's TensorRT) built this plan."""
        if tensorrt_release(version) != tensorrt_release(self.tensorrt_version):
            raise PlanVersionMismatch(
                f"the plan was built with TensorRT {self.tensorrt_version}, {loader} has "
                f"TensorRT {version}: a plan loads only in the TensorRT release that built "
                "it; rebuild it with `encoder build-plan` where `pip install '.[gpu]'` "
                f"installed TensorRT {tensorrt_release(version)}"
            )
