"""Fine-tune the dual encoder (SDE, ADE, ADE-STE, ADE-FTE, ADE-SPL) on a BEIR train split.

A run, in named steps: :func:`_setup` (check the request, load data and towers, mine the
hard negatives and the dev pool with the base model, build the optimiser), :func:`_resume`
(from ``trainer_state.pt``), :func:`_run_steps` (the optimiser steps, the pool
evaluations, the periodic checkpoints) and :func:`_finish` (the checkpoint, its manifest,
the exact dev metrics, the curve).

The loss and its GradCache accumulation, the batches and the optimiser are in
:mod:`services.encoder.train.steps`; what a run records (the dev pool's nDCG, the
trainer state, the manifest, the plot) in :mod:`services.encoder.train.progress`; the
recipe in :mod:`services.encoder.train.config`. Everything sampled is derived from
``(seed, step)``, so a run resumed from ``trainer_state.pt`` sees the same batches as an
uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.encoder.model import (
    DualEncoder,
    default_model_dir,
    load_tokenizer_spec,
    read_layout,
)
from services.encoder.textcodec import TextCodec
from services.encoder.train.config import TrainConfig
from services.encoder.train.data import (
    LazyEncoder,
    TrainingData,
    base_ranks,
    eval_corpus,
    hold_out,
    load_training_data,
    mine_negatives,
    model_key,
    negatives_from_run,
)
from services.encoder.train.manifest import MANIFEST, read_manifest, write_manifest
from services.encoder.train.progress import (
    CURVE_PNG,
    TRAINER_STATE,
    DevPool,
    build_manifest,
    plot_curve,
    save_state,
    usage,
)
from services.encoder.train.steps import Batches, in_batch_loss, optimizer, schedule, step_loss
from services.encoder.train.towers import (
    ARCHS,
    Arch,
    Towers,
    build_towers,
    check_arch,
    save_towers,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    out: Path
    manifest: dict[str, Any]


def validate(cfg: TrainConfig) -> tuple[Arch, Path]:
    """Everything checkable before a file is written (bad input writes nothing)."""
    arch = check_arch(cfg.arch)
    base = Path(cfg.base) if cfg.base else default_model_dir()
    read_layout(base)
    if cfg.batch_size < 2:
        raise InvalidArgument("batch size must be >= 2 (in-batch negatives need company)")
    if cfg.micro_batch is not None and not 1 <= cfg.micro_batch <= cfg.batch_size:
        raise InvalidArgument("micro batch must be between 1 and the batch size")
    if cfg.negatives < 0 or cfg.epochs <= 0 or cfg.lr <= 0 or cfg.temperature <= 0:
        raise InvalidArgument("negatives must be >= 0; epochs, lr and temperature > 0")
    if cfg.max_query_len < 4 or cfg.max_doc_len < 4:
        raise InvalidArgument("max query / document lengths must be >= 4 tokens")
    out = Path(cfg.out)
    if cfg.resume and not (out / TRAINER_STATE).exists():
        raise NotFound(f"--resume: no {TRAINER_STATE} in {out}")
    if not cfg.resume and (out / MANIFEST).exists():
        raise FailedPrecondition(f"{out} already holds a checkpoint: choose another --out")
    return arch, base


def check_index_dim(dim: int, index_dir: Path, what: str) -> None:
    """The serving index holds vectors of one width; another width needs a new index."""
    from services.index.core.train import Manifest

    index_dim = Manifest.read(Path(index_dir)).dim
    if index_dim != dim:
        raise FailedPrecondition(
            f"{what} embeds in {dim} dimensions but the serving index {index_dir} holds "
            f"{index_dim}-d vectors: it needs a new index generation (`index train` on "
            "vectors of the new encoder, then re-ingest the corpus) before it can serve"
        )


def _codec(base: Path, cfg: TrainConfig) -> TextCodec:
    from tokenizers import Tokenizer

    spec = load_tokenizer_spec(base)
    limit = read_layout(base).max_seq_length
    lens = {"query": min(cfg.max_query_len, limit), "document": min(cfg.max_doc_len, limit)}
    return TextCodec(Tokenizer.from_str(spec.tokenizer_json), lens, spec.pad_id)


@dataclass
class _Run:
    """One run's parts, set up by :func:`_setup`, and what it has measured so far."""

    cfg: TrainConfig
    arch: Arch
    base: Path
    out: Path
    td: TrainingData
    towers: Towers
    dim: int
    codec: TextCodec
    batches: Batches
    pool: DevPool | None
    opt: torch.optim.Optimizer
    sched: Any
    mine_seconds: float
    wall0: float
    cpu0: float
    start: int = 0
    losses: list[float] = field(default_factory=list)
    curve: list[dict[str, Any]] = field(default_factory=list)
    trained_s: float = 0.0  # training time of the runs this one resumes
    eval_s: float = 0.0  # time of the pool evaluations, left out of the training time

    def manifest(self, step: int, dev: dict[str, Any], timing: dict[str, Any]) -> dict[str, Any]:
        return build_manifest(
            self.cfg,
            self.arch,
            self.base,
            self.td,
            self.towers,
            self.dim,
            step,
            self.batches.steps,
            self.losses,
            self.curve,
            dev,
            timing,
        )


def train(cfg: TrainConfig) -> TrainResult:
    """Train (or resume) one architecture; write the checkpoint(s) and manifest to ``cfg.out``."""
    run = _setup(cfg)
    if cfg.resume:
        _resume(run)
    stopped = _run_steps(run)
    return stopped if stopped is not None else _finish(run)


def _setup(cfg: TrainConfig) -> _Run:
    """Check the request, load the data and the towers, mine the hard negatives and the
    dev pool with the base model, and build the optimiser."""
    arch, base = validate(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    wall0, cpu0 = time.perf_counter(), usage()["cpu_seconds"]
    torch.manual_seed(cfg.seed)
    td = hold_out(load_training_data(cfg.data_dir, cfg.seed, cfg.dev_fraction), cfg.holdout)
    towers = build_towers(base, arch)
    dim = _dim(towers.query)
    if cfg.index_dir is not None:
        check_index_dim(dim, cfg.index_dir, f"the checkpoint {base}")
    codec = _codec(base, cfg)
    key = model_key(base)
    encode = LazyEncoder(base)
    mine0 = time.perf_counter()
    if not cfg.negatives:
        negatives: dict[str, list[str]] = {}
    elif cfg.negatives_file is not None:
        negatives = negatives_from_run(
            td, cfg.negatives_file, cfg.negative_skip, cfg.negative_depth
        )
    else:
        negatives = mine_negatives(
            td, encode, key, cfg.negative_skip, cfg.negative_depth, cfg.progress
        )
    pool = (
        DevPool(td, base_ranks(td, td.dev_qids, encode, key, cfg.dev_pool_depth, cfg.progress))
        if cfg.eval_every
        else None
    )
    mine_seconds = time.perf_counter() - mine0
    del encode
    batches = Batches(td, negatives, cfg)
    opt = optimizer(towers, cfg)
    sched = schedule(opt, batches.steps, cfg.warmup_fraction)
    return _Run(
        cfg,
        arch,
        base,
        Path(cfg.out),
        td,
        towers,
        dim,
        codec,
        batches,
        pool,
        opt,
        sched,
        mine_seconds,
        wall0,
        cpu0,
    )


def _resume(run: _Run) -> None:
    """Continue where the saved trainer state stopped (its recipe must be this one)."""
    state = torch.load(run.out / TRAINER_STATE, map_location="cpu", weights_only=False)
    if state["recipe"] != run.cfg.recipe() or state["arch"] != run.arch:
        raise FailedPrecondition(f"--resume: {run.out} was trained with another arch or recipe")
    run.towers.load_state_dict(state["towers"])
    run.opt.load_state_dict(state["optimizer"])
    run.sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    run.start, run.losses = int(state["step"]), list(state["losses"])
    run.curve = list(state["curve"])
    run.trained_s = float(state["train_seconds"])


def _run_steps(run: _Run) -> TrainResult | None:
    """The steps from ``run.start``; the result when ``stop_after`` stops the run early
    (with a resumable checkpoint), else None and ``run.trained_s`` the whole training time."""
    from tqdm import tqdm

    cfg, batches, towers = run.cfg, run.batches, run.towers
    towers.train(True)
    bar = tqdm(
        range(run.start, batches.steps),
        initial=run.start,
        total=batches.steps,
        desc=f"train {run.arch}",
        disable=not cfg.progress,
    )
    seg = time.perf_counter()
    for step in bar:
        run.losses.append(_step(run, step))
        done = step + 1
        bar.set_postfix(loss=f"{np.mean(run.losses[-10:]):.3f}")
        if (
            run.pool is not None
            and done % cfg.eval_every == 0
            and (done < batches.steps or not cfg.final_eval)
        ):  # the last step's figure is the exact one (final_eval)
            e0 = time.perf_counter()
            ndcg = round(run.pool.ndcg(towers, run.codec), 4)
            run.curve.append({"step": done, "dev_pool_ndcg_at_10": ndcg})
            run.eval_s += time.perf_counter() - e0
            log.info("step %d: dev pool nDCG@10 %.4f", done, run.curve[-1]["dev_pool_ndcg_at_10"])
        stop = cfg.stop_after is not None and done >= cfg.stop_after and done < batches.steps
        if stop or (
            cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < batches.steps
        ):
            _checkpoint(run, done, run.trained_s + time.perf_counter() - seg - run.eval_s)
        if stop:
            bar.close()
            return TrainResult(run.out, json.loads((run.out / MANIFEST).read_text()))
    bar.close()
    run.trained_s += time.perf_counter() - seg - run.eval_s
    return None


def _step(run: _Run, step: int) -> float:
    """One optimiser step on batch ``step``; its loss."""
    td, cfg = run.td, run.cfg
    qids, dids, _ = run.batches.step(step)
    texts_q = [td.data.queries[q] for q in qids]
    texts_d = [td.data.docs[d] for d in dids]
    qrels = td.data.qrels

    def loss_fn(
        q: torch.Tensor, d: torch.Tensor, qids: list[str] = qids, dids: list[str] = dids
    ) -> torch.Tensor:
        return in_batch_loss(q, d, qids, dids, qrels, cfg.temperature)

    run.opt.zero_grad(set_to_none=True)
    loss = step_loss(run.towers, run.codec, texts_q, texts_d, loss_fn, cfg.micro_batch)
    torch.nn.utils.clip_grad_norm_(run.towers.parameters(), cfg.grad_clip)
    run.opt.step()
    run.sched.step()
    return loss


def _checkpoint(run: _Run, done: int, elapsed: float) -> None:
    """A resumable checkpoint after step ``done``: trainer state, towers, manifest."""
    save_state(
        run.out,
        run.towers,
        run.opt,
        run.sched,
        run.cfg,
        run.arch,
        done,
        run.losses,
        run.curve,
        elapsed,
    )
    save_towers(run.towers, run.base, run.out)
    write_manifest(run.out, run.manifest(done, {}, {"train_seconds": elapsed}))


def _finish(run: _Run) -> TrainResult:
    """The complete checkpoint: towers, manifest with timings, the exact dev metrics
    (``final_eval``), the curve's plot."""
    cfg, out, steps = run.cfg, run.out, run.batches.steps
    run.towers.train(False)
    save_towers(run.towers, run.base, out)
    (out / TRAINER_STATE).unlink(missing_ok=True)
    used = usage()
    timing = {
        "train_seconds": round(run.trained_s, 1),
        "mine_seconds": round(run.mine_seconds, 1),
        "pool_eval_seconds": round(run.eval_s, 1),
        "wall_seconds": round(time.perf_counter() - run.wall0, 1),
        "cpu_seconds": round(used["cpu_seconds"] - run.cpu0, 1),
        "peak_rss_mib": round(used["peak_rss_mib"], 1),
        "threads": torch.get_num_threads(),
        "resumed": cfg.resume,
    }
    dev: dict[str, Any] = {}
    manifest = run.manifest(steps, dev, timing)
    write_manifest(out, manifest)
    if cfg.final_eval:
        from services.encoder.train.evaluate import dev_metrics

        e0 = time.perf_counter()
        sample = eval_corpus(run.td, cfg.eval_corpus, cfg.seed)
        dev.update(dev_metrics(out, sample, cfg.progress, cfg.eval_doc_len))
        dev["eval_corpus"] = cfg.eval_corpus
        run.curve.append({"step": steps, "dev_exact_ndcg_at_10": dev["ndcg_at_10"]})
        timing["dev_eval_seconds"] = round(time.perf_counter() - e0, 1)
        timing["peak_rss_mib"] = round(usage()["peak_rss_mib"], 1)
        manifest = run.manifest(steps, dev, timing)
        write_manifest(out, manifest)
    plot_curve(manifest, out / CURVE_PNG)
    return TrainResult(out, manifest)


def _dim(tower: DualEncoder) -> int:
    probe = torch.ones(1, 2, dtype=torch.long)
    with torch.no_grad():
        return int(tower(probe, probe).shape[-1])


__all__ = ["ARCHS", "TrainConfig", "TrainResult", "read_manifest", "train"]
