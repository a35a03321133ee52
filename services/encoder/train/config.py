"""The recipe of one ``encoder train`` run (``gtr-retrieval encoder train`` flags)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.encoder.train.towers import Arch


@dataclass(frozen=True)
class TrainConfig:
    """One run: its data, where it writes, the architecture and the recipe."""

    data_dir: Path
    out: Path
    arch: Arch = "sde"
    base: Path | None = None  # None: the packaged all-MiniLM-L6-v2
    epochs: float = 1.0
    batch_size: int = 16
    micro_batch: int | None = None  # GradCache chunk (None: the whole batch at once)
    lr: float = 2e-5
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    temperature: float = 0.05
    negatives: int = 1  # hard negatives per pair (0: in-batch negatives only)
    negative_skip: int = 3  # mined from the base model's ranks skip+1 … negative_depth
    negative_depth: int = 20
    # The ranked lists negatives are mined from: a JSON file {query id: [doc id, ...]} of
    # any first stage (``gtr-retrieval tune`` writes its hybrid run); None: the base
    # checkpoint's exact dense ranks. Ranks skip+1 … negative_depth either way.
    negatives_file: Path | None = None
    # Judged queries kept out of training besides dev (``tune``'s validation split).
    holdout: tuple[str, ...] = ()
    max_query_len: int = 64
    max_doc_len: int = 192
    seed: int = 13
    dev_fraction: float = 0.2
    eval_every: int = 16  # dev nDCG@10 on the pool every N steps (0: never)
    dev_pool_depth: int = 5
    checkpoint_every: int = 0  # also save (with trainer_state.pt) every N steps
    resume: bool = False
    stop_after: int | None = None  # stop with a resumable checkpoint after this step
    index_dir: Path | None = None  # the serving index: its dimension must match
    threads: int | None = None
    final_eval: bool = True  # exact dev metrics over the corpus into the manifest
    eval_doc_len: int | None = None  # documents' tokens in that evaluation (None: serving)
    eval_corpus: int | None = None  # evaluate on a sample of this many documents (None: all)
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def recipe(self) -> dict[str, Any]:
        keep = (
            "epochs",
            "batch_size",
            "micro_batch",
            "lr",
            "warmup_fraction",
            "weight_decay",
            "grad_clip",
            "temperature",
            "negatives",
            "negative_skip",
            "negative_depth",
            "negatives_file",
            "max_query_len",
            "max_doc_len",
            "seed",
            "dev_fraction",
        )
        recipe = {k: v for k, v in asdict(self).items() if k in keep}
        recipe["negatives_file"] = None if self.negatives_file is None else str(self.negatives_file)
        if self.holdout:
            recipe["holdout_queries"] = len(self.holdout)
        return recipe
