"""The faiss-gpu API mirror the GPU tests run against (no GPU here).

:class:`FakeGpuIndex` behaves like faiss-gpu's IVF-PQ in what matters: it refuses k and
nprobe above 2,048 (and an index whose stored nprobe is larger), has no ``remove_ids``,
counts two threads inside it at once, and fails if anyone sets ``nprobe`` on it.
:class:`StrictFaissGpu` is the faiss-gpu module as far as the copy uses it: the wheel's
own names and class attributes (``faiss_gpu_api.json``, extracted by
``scripts/faiss_gpu_api.py`` from its ``swigfaiss.py``); it refuses any other, so a test
never passes on a name the real wheel lacks. (The real wheel refuses nothing: its SWIG
proxies take an unknown attribute silently and faiss never reads it.) Used by
``tests/unit/test_index_gpu.py``, ``test_index_gpu_stale.py`` and ``test_rollout_gpu.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from services.index.core.gpu import GPU_MAX_K

FAISS_GPU_API = json.loads((Path(__file__).parent / "faiss_gpu_api.json").read_text())


def unit(n: int, dim: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class FakeGpuIndex:
    """Answers from a CPU copy; asserts the constraints faiss-gpu has."""

    def __init__(self, cpu_index: faiss.Index) -> None:
        nprobe = int(faiss.extract_index_ivf(cpu_index).nprobe)
        if not 0 < nprobe <= GPU_MAX_K:  # GpuIndexIVF::copyFrom -> validateNProbe
            raise RuntimeError(
                f"GPU IVF index only supports nprobe selection up to {GPU_MAX_K} "
                f"(requested {nprobe})"
            )
        self._index = faiss.clone_index(cpu_index)
        self._inside = 0
        self.calls: list[tuple[int, int]] = []
        self.overlaps = 0

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "nprobe":
            raise AssertionError("nprobe set on a shared GPU index (a race between searches)")
        super().__setattr__(name, value)

    def search(self, x: np.ndarray, k: int, params: Any = None) -> tuple[np.ndarray, np.ndarray]:
        assert k <= GPU_MAX_K, f"faiss-gpu refuses k={k}"
        assert isinstance(params, faiss.SearchParametersIVF), "nprobe must come per call"
        assert params.nprobe <= GPU_MAX_K, f"faiss-gpu refuses nprobe={params.nprobe}"
        self._inside += 1
        if self._inside > 1:
            self.overlaps += 1
        time.sleep(0.002)
        try:
            self.calls.append((k, int(params.nprobe)))
            scores, ids = self._index.search(x, k, params=params)
            return scores, ids
        finally:
            self._inside -= 1

    def add_with_ids(self, x: np.ndarray, ids: np.ndarray) -> None:
        self._index.add_with_ids(x, ids)

    def remove_ids(self, sel: Any) -> int:  # faiss/Index.cpp: GPU IVF indexes inherit this
        raise RuntimeError("remove_ids not implemented for this type of index")


class StrictSwig:
    """An instance of a faiss-gpu SWIG class: refuses attributes the class does not have."""

    _cls: str
    values: dict[str, Any]

    def __init__(self, cls: str) -> None:
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "values", {})

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in FAISS_GPU_API["classes"][self._cls]:  # stricter than the wheel
            raise AttributeError(f"You cannot add instance attributes to {self._cls}")
        self.values[name] = value


class StrictFaissGpu:
    """The faiss-gpu module as far as the copy uses it; unknown names are AttributeErrors."""

    def __init__(self) -> None:
        self.copies: list[tuple[int, StrictSwig]] = []

    def __getattr__(self, name: str) -> Any:
        if name not in FAISS_GPU_API["module"]:
            raise AttributeError(f"module 'faiss' (faiss-gpu) has no attribute {name!r}")
        if name in FAISS_GPU_API["classes"]:
            return lambda: StrictSwig(name)
        if name.startswith("INDICES_"):
            return name
        raise AttributeError(f"{name}: not modelled by the test (add it)")

    def index_cpu_to_gpu(
        self, resources: StrictSwig, device: int, index: faiss.Index, options: StrictSwig
    ) -> FakeGpuIndex:
        assert resources._cls == "StandardGpuResources"
        assert options._cls == "GpuClonerOptions"
        self.copies.append((device, options))
        return FakeGpuIndex(index)
