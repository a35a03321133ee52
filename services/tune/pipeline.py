"""The stages of a tuning run, each resumable from what it left in ``<out>``.

1. the split (:mod:`.splits`) and the serving encoder's lists; its fusion chosen on the
   validation queries, its hybrid run written for the trainers' negatives;
2. each encoder asked for, trained with negatives from the serving hybrid run or the
   base model's dense ranks (``encoder train`` with the validation queries held out),
   its lists and its fusion;
3. the best first stage on the validation queries; each reranker trained on it
   (:mod:`.rerankers`), its candidates scored once, its depth (within the budget) and
   weight chosen on the validation queries;
4. the report (:mod:`.report`) and the retrieval setting of the best system.

A stage whose result is in ``<out>`` is not run again: rerunning the same command after
an interruption continues where it stopped (the trainers resume from their checkpoints).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from services.common.fusion import RetrievalDefaults
from services.corpus.beir import BeirData, load_beir
from services.encoder.serve.versions import write_atomically
from services.tune.choice import (
    FusionChoice,
    RerankChoice,
    choose_fusion,
    choose_rerank,
    fused_scored,
    ids,
    reranked,
)
from services.tune.config import CONFIG_FILE, TuneConfig, validate
from services.tune.lists import Lists, ScoredRun, lists_for
from services.tune.report import System, build_report, head_to_head
from services.tune.rerankers import score_candidates, train_reranker
from services.tune.rollout import rollout_plan, rollout_setting
from services.tune.splits import Split, make_split

log = logging.getLogger(__name__)
REPORT_FILE = "report.json"
SETTING_FILE = "retrieval_setting.json"
# the part of it a generation records: `index rollout --retrieval-setting` (.rollout)
ROLLOUT_SETTING_FILE = "rollout_setting.json"
T = TypeVar("T")


class Timer:
    """Wall seconds per stage, summed over every run of the same ``RUN`` (``seconds.json``):
    a resumed run adds what it spent, a stage found done adds next to nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    def run(self, name: str, fn: Callable[[], T]) -> T:
        log.info("tune: %s", name)
        start = time.perf_counter()
        try:
            return fn()
        finally:
            spent = time.perf_counter() - start
            self.seconds[name] = round(self.seconds.get(name, 0.0) + spent, 1)
            _write_json(self.path, self.seconds)


def _write_json(path: Path, payload: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(payload, indent=1))
    return path


def train_encoder(
    cfg: TuneConfig, arch: str, source: str, split: Split, negatives: Path | None, out: Path
) -> dict[str, Any]:
    """``encoder train`` with the recipe of docs/encoder.md (resumed or found done)."""
    from services.encoder.train.manifest import MANIFEST
    from services.encoder.train.progress import TRAINER_STATE

    record: dict[str, Any] = {
        "arch": arch,
        "negatives": source,
        "checkpoint": str(out),
        "epochs": cfg.encoder_epochs,
        "batch_size": cfg.encoder_batch_size,
    }
    if not ((out / MANIFEST).exists() and not (out / TRAINER_STATE).exists()):
        _train_encoder(cfg, arch, split, negatives, out)
    manifest = json.loads((out / MANIFEST).read_text())
    record["steps"] = manifest.get("steps")
    record["timing"] = manifest.get("timing", {})  # the trainer's own (the last run's)
    return record


def _train_encoder(
    cfg: TuneConfig, arch: str, split: Split, negatives: Path | None, out: Path
) -> None:
    from services.encoder.train.config import TrainConfig
    from services.encoder.train.progress import TRAINER_STATE
    from services.encoder.train.trainer import train

    train(
        TrainConfig(
            data_dir=Path(cfg.data_dir),
            out=out,
            arch=arch,  # type: ignore[arg-type]
            base=cfg.serving_encoder,
            epochs=cfg.encoder_epochs,
            batch_size=cfg.encoder_batch_size,
            negatives_file=negatives,
            holdout=split.val,
            seed=cfg.seed,
            dev_fraction=cfg.dev_fraction,
            eval_every=0,
            checkpoint_every=25,
            resume=(out / TRAINER_STATE).exists(),
            final_eval=False,
            progress=cfg.progress,
        )
    )


def run(cfg: TuneConfig, command: str = "gtr-retrieval tune") -> dict[str, Any]:
    """Every stage; the report (also written to ``<out>/report.json``). ``command``: the
    command line, recorded in the report."""
    validate(cfg)
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / CONFIG_FILE, cfg.recorded())
    timer = Timer(out / "seconds.json")
    beir = load_beir(Path(cfg.data_dir))
    split = make_split(beir.qrels, cfg.seed, cfg.dev_fraction, cfg.val_fraction)
    split.write(out / "split.json")
    qids = sorted({*split.train, *split.val, *split.dev})
    val, dev = list(split.val), list(split.dev)
    depth = min(cfg.depth, len(beir.doc_ids))

    lists: dict[str, Lists] = {}
    checkpoints: dict[str, str | None] = {}
    fusion: dict[str, FusionChoice] = {}
    grids: dict[str, Any] = {}
    trained: dict[str, Any] = {}

    def add_encoder(name: str, ckpt: Path | None) -> None:
        lists[name] = timer.run(
            f"lists {name}",
            lambda: lists_for(name, beir, ckpt, qids, depth, out, cfg.progress),
        )
        checkpoints[name] = None if ckpt is None else str(ckpt)
        fusion[name], grids[name] = choose_fusion(lists[name], beir.qrels, val, depth)

    add_encoder("serving", cfg.serving_encoder)
    serving_hybrid = _hybrid(lists["serving"], fusion["serving"], qids, depth)
    negatives_file = _write_json(out / "runs" / "serving-hybrid.json", ids(serving_hybrid))
    for arch in cfg.encoders:
        for source in cfg.encoder_negatives:
            name = f"{arch}-{source}"
            ckpt = out / "encoders" / name
            trained[name] = timer.run(
                f"train encoder {name}",
                lambda a=arch, s=source, c=ckpt: train_encoder(  # type: ignore[misc]
                    cfg, a, s, split, negatives_file if s == "hybrid" else None, c
                ),
            )
            add_encoder(name, ckpt)

    systems = _first_stages(lists, fusion, checkpoints, qids, depth)
    best_fs = max(
        (n for n, s in systems.items() if s.kind == "first_stage"),
        key=lambda n: _val_ndcg(systems[n], beir, val),
    )
    first = _scored_first_stage(best_fs, lists, fusion, qids, depth)
    first_file = _write_json(out / "runs" / "best-first-stage.json", ids(first))
    rerank_info = _rerankers(cfg, beir, split, first, first_file, best_fs, systems, timer)

    report = build_report(systems, beir.qrels, val, dev, "serving/hybrid-default")
    report["head_to_head"] = head_to_head(
        systems, beir.qrels, dev, _recipe_pairs(cfg, best_fs, depth)
    )
    report.update(_record(cfg, command, split, trained, lists, fusion, grids, best_fs))
    report["rerank"] = rerank_info
    report["ceiling"] = {
        name: {"ndcg_at_10": report["systems"][name]["ndcg_at_10"]}
        for name, s in systems.items()
        if s.kind == "ceiling"
    }
    report["seconds"] = timer.seconds
    best = report["best"]
    rollout_setting(best["system"], best["setting"]).write(out / ROLLOUT_SETTING_FILE)
    report["rollout"] = rollout_plan(report, out, out / ROLLOUT_SETTING_FILE)
    _write_json(out / REPORT_FILE, report)
    _write_json(out / SETTING_FILE, report["best"]["setting"])
    return report


def _add_reranked(
    systems: dict[str, System],
    name: str,
    first: ScoredRun,
    scores: dict[str, dict[str, float]],
    val: Sequence[str],
    beir: BeirData,
    allowed: list[int],
    depth: int,
    ckpt: Path,
) -> tuple[RerankChoice, RerankChoice | None, list[dict[str, Any]]]:
    """The reranked systems of one reranker: every candidate reranked (the ceiling, or
    within the budget) and the depth and weight chosen on ``val`` within the budget."""
    setting = dict(systems[name.split("+")[0]].setting, rerank_checkpoint=str(ckpt))
    top, _ = choose_rerank(first, scores, beir.qrels, val, [depth])
    assert top is not None
    systems[f"{name}@{depth}"] = System(
        reranked(first, scores, depth, top.weight),
        "reranked" if depth in allowed else "ceiling",
        {**setting, "rerank_depth": depth, "rerank_weight": top.weight},
        eligible=depth in allowed,
    )
    choice, grid = choose_rerank(first, scores, beir.qrels, val, allowed)
    if choice is not None and choice.depth != depth:
        systems[name] = System(
            reranked(first, scores, choice.depth, choice.weight),
            "reranked",
            {**setting, "rerank_depth": choice.depth, "rerank_weight": choice.weight},
        )
    return top, choice, grid


def _recipe_pairs(cfg: TuneConfig, best_fs: str, depth: int) -> list[tuple[str, str]]:
    """(today's recipe, the new one) pairs the report compares head to head."""
    pairs = [
        (f"{arch}-dense/{mode}", f"{arch}-hybrid/{mode}")
        for arch in cfg.encoders
        for mode in ("dense", "hybrid")
    ]
    pairs += [
        (f"{best_fs}+celi-dense{at}", f"{best_fs}+celi-hybrid{at}") for at in ("", f"@{depth}")
    ]
    return pairs


def _record(
    cfg: TuneConfig,
    command: str,
    split: Split,
    trained: dict[str, Any],
    lists: dict[str, Lists],
    fusion: dict[str, FusionChoice],
    grids: dict[str, Any],
    best_fs: str,
) -> dict[str, Any]:
    """What the report records besides the systems: the command, the recipe, the choices."""
    return {
        "command": command,
        "config": cfg.to_dict(),
        "split": _split_record(split),
        "encoders": trained,
        "index": {name: ls.info for name, ls in lists.items()},
        "fusion": {name: c.describe() for name, c in fusion.items()},
        "fusion_grid": grids,
        "best_first_stage": best_fs,
    }


def _split_record(split: Split) -> dict[str, Any]:
    return {
        "seed": split.seed,
        "train": len(split.train),
        "val": len(split.val),
        "dev": len(split.dev),
        "rule": "dev: the trainers' split (seed, dev fraction); val: a share of the "
        "rest, held out of all training; every choice is made on val",
    }


def _hybrid(lists: Lists, choice: FusionChoice, qids: list[str], depth: int) -> ScoredRun:
    return fused_scored(lists, choice.fusion, choice.candidates, qids, depth)


def _first_stages(
    lists: dict[str, Lists],
    fusion: dict[str, FusionChoice],
    checkpoints: dict[str, str | None],
    qids: list[str],
    depth: int,
) -> dict[str, System]:
    defaults = RetrievalDefaults()
    serving = lists["serving"]
    systems = {
        "serving/hybrid-default": System(
            ids(fused_scored(serving, defaults.fusion, defaults.candidates, qids, depth)),
            "first_stage",
            {
                "encoder": checkpoints["serving"],
                "mode": "hybrid",
                "fusion": FusionChoice(defaults.fusion, defaults.candidates, 0.0).describe(),
            },
        ),
        "bm25": System({q: [d for d, _ in serving.sparse[q]] for q in qids}, "first_stage"),
    }
    for name, ls in lists.items():
        enc = {"encoder": checkpoints[name]}
        systems[f"{name}/dense"] = System(
            {q: [d for d, _ in ls.dense[q]] for q in qids}, "first_stage", {**enc, "mode": "dense"}
        )
        systems[f"{name}/hybrid"] = System(
            ids(_hybrid(ls, fusion[name], qids, depth)),
            "first_stage",
            {**enc, "mode": "hybrid", "fusion": fusion[name].describe()},
        )
        systems[f"{name}/exact-dense"] = System(
            ls.exact, "ceiling", {**enc, "mode": "dense", "index": "exact"}
        )
    return systems


def _scored_first_stage(
    name: str, lists: dict[str, Lists], fusion: dict[str, FusionChoice], qids: list[str], depth: int
) -> ScoredRun:
    if name == "bm25":
        return lists["serving"].sparse
    if name == "serving/hybrid-default":
        defaults = RetrievalDefaults()
        return fused_scored(lists["serving"], defaults.fusion, defaults.candidates, qids, depth)
    encoder, mode = name.split("/")
    return (
        lists[encoder].dense
        if mode == "dense"
        else _hybrid(lists[encoder], fusion[encoder], qids, depth)
    )


def _val_ndcg(system: System, beir: BeirData, val: list[str]) -> float:
    from services.measures.ranking import score

    return score({q: system.run[q] for q in val}, beir.qrels, val).mean("ndcg_at_10")


def _rerankers(
    cfg: TuneConfig,
    beir: BeirData,
    split: Split,
    first: ScoredRun,
    first_file: Path,
    best_fs: str,
    systems: dict[str, System],
    timer: Timer,
) -> dict[str, Any]:
    from services.rerank.depths import depth_table

    out = Path(cfg.out)
    depth = min(cfg.depth, len(beir.doc_ids))
    table = depth_table(cfg.depth_table)
    budget = cfg.budget_ms()
    allowed = sorted(d for d, ms in table.items() if ms <= budget and d <= depth)
    scored_qids = [*split.val, *split.dev]
    info: dict[str, Any] = {}
    for source in cfg.rerankers:
        name = f"celi-{source}"
        ckpt = out / "rerankers" / name
        record = timer.run(
            f"train reranker {name}",
            lambda s=source, c=ckpt: train_reranker(  # type: ignore[misc]
                cfg, s, split.val, first_file if s == "hybrid" else None, c
            ),
        )
        scores = timer.run(
            f"score {name}",
            lambda c=ckpt, n=name: score_candidates(  # type: ignore[misc]
                c, beir, ids(first), scored_qids, depth, out / "scores" / f"{n}.json", cfg.progress
            ),
        )
        top, choice, grid = _add_reranked(
            systems, f"{best_fs}+{name}", first, scores, split.val, beir, allowed, depth, ckpt
        )
        info[name] = {
            **record,
            "budget_ms": budget,
            "depth_table_ms": {str(d): ms for d, ms in sorted(table.items())},
            "depths_within_budget": allowed,
            "chosen": None
            if choice is None
            else {
                "depth": choice.depth,
                "weight": choice.weight,
                "val_ndcg_at_10": round(choice.val_ndcg_at_10, 4),
            },
            "at_full_depth": {
                "depth": depth,
                "weight": top.weight,
                "val_ndcg_at_10": round(top.val_ndcg_at_10, 4),
            },
            "grid": grid,
        }
    return info
