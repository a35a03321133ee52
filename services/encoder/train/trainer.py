"""Fine-tune the dual encoder (SDE, ADE, ADE-STE, ADE-FTE, ADE-SPL) on a BEIR train split.

Loss (GTR §3, Ni et al. 2021): in-batch sampled softmax. For a batch of B (query,
positive) pairs plus ``negatives`` hard negatives per pair, each query is scored against
all B·(1 + negatives) documents of the batch, the similarities divided by
``temperature`` (0.05 = sentence-transformers' scale 20, all-MiniLM-L6-v2's own), and
the loss is the cross-entropy of its positive. A document judged relevant to the query
but sitting in another row (two positives of one query in a batch) is masked, not
counted as a negative.

``micro_batch`` < ``batch_size`` is gradient accumulation that keeps the softmax over
the whole batch (GradCache, Gao et al. 2021): embeddings are computed chunk by chunk
without a graph, the loss and its gradient w.r.t. the embeddings over the full batch,
then each chunk is re-encoded with a graph (same dropout masks: the RNG state is
replayed) and back-propagated with its slice of that gradient. It costs one more
forward pass and lets a CPU train with a batch whose activations would not fit.

Everything sampled is derived from ``(seed, step)``, so a run resumed from
``trainer_state.pt`` sees the same batches as an uninterrupted one. Every
``eval_every`` steps the dev nDCG@10 is measured on a pool (the base model's top
``dev_pool_depth`` of each dev query plus its judged documents, re-encoded by the
current towers) — cheap enough to plot; the manifest's dev metrics are exact search
over the whole corpus with the saved checkpoint (:mod:`services.encoder.train.evaluate`).
"""

from __future__ import annotations

import json
import logging
import math
import random
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.encoder.model import (
    DualEncoder,
    default_model_dir,
    load_tokenizer_spec,
    model_name_of,
    read_layout,
)
from services.encoder.textcodec import TextCodec, TokenBatch
from services.encoder.train.data import (
    LazyEncoder,
    TrainingData,
    base_ranks,
    eval_corpus,
    ids_digest,
    load_training_data,
    mine_negatives,
    model_key,
)
from services.encoder.train.manifest import MANIFEST, read_manifest, write_manifest
from services.encoder.train.towers import (
    ARCHS,
    Arch,
    Towers,
    build_towers,
    check_arch,
    is_asymmetric,
    save_towers,
)
from services.measures.ranking import score

log = logging.getLogger(__name__)
TRAINER_STATE = "trainer_state.pt"
CURVE_PNG = "training.png"


@dataclass(frozen=True)
class TrainConfig:
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
            "max_query_len",
            "max_doc_len",
            "seed",
            "dev_fraction",
        )
        return {k: v for k, v in asdict(self).items() if k in keep}


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


class Batches:
    """The examples of every step, a pure function of ``(seed, step)``."""

    def __init__(self, td: TrainingData, negatives: dict[str, list[str]], cfg: TrainConfig):
        self.td, self.negatives, self.cfg = td, negatives, cfg
        self.total = max(1, round(len(td.pairs) * cfg.epochs))
        self.steps = math.ceil(self.total / cfg.batch_size)

    def _pair(self, slot: int) -> tuple[str, str]:
        epoch, at = divmod(slot, len(self.td.pairs))
        order = list(self.td.pairs)
        random.Random(f"{self.cfg.seed}:epoch:{epoch}").shuffle(order)
        return order[at]

    def step(self, step: int) -> tuple[list[str], list[str], list[str]]:
        """(query ids, document ids, row ids) — documents: B positives, then negatives."""
        first = step * self.cfg.batch_size
        pairs = [self._pair(s) for s in range(first, min(first + self.cfg.batch_size, self.total))]
        qids = [q for q, _ in pairs]
        docs = [d for _, d in pairs]
        for slot, (qid, _) in enumerate(pairs, start=first):
            pool = self.negatives.get(qid, [])
            if self.cfg.negatives and pool:
                rng = random.Random(f"{self.cfg.seed}:{step}:{slot}")
                docs += rng.sample(pool, min(self.cfg.negatives, len(pool)))
        return qids, docs, qids


def in_batch_loss(
    q: torch.Tensor,
    d: torch.Tensor,
    qids: list[str],
    dids: list[str],
    qrels: dict[str, dict[str, int]],
    temperature: float,
) -> torch.Tensor:
    """Sampled softmax: query i's positive is document i; other judged positives masked."""
    logits = q @ d.T / temperature
    mask = torch.zeros_like(logits, dtype=torch.bool)
    for i, qid in enumerate(qids):
        for j, did in enumerate(dids):
            if j != i and did in qrels[qid]:
                mask[i, j] = True
    logits = logits.masked_fill(mask, float("-inf"))
    return torch.nn.functional.cross_entropy(logits, torch.arange(len(qids)))


def _forward(tower: DualEncoder, batch: TokenBatch) -> torch.Tensor:
    return tower(torch.from_numpy(batch.input_ids), torch.from_numpy(batch.attention_mask))


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def step_loss(
    towers: Towers,
    codec: TextCodec,
    texts_q: list[str],
    texts_d: list[str],
    loss_fn: Any,
    micro: int | None,
) -> float:
    """Forward + backward of one batch (GradCache when ``micro`` is smaller); the loss."""
    if micro is None or micro >= len(texts_q):
        q = _forward(towers.query, codec.encode(texts_q, "query"))
        d = _forward(towers.document, codec.encode(texts_d, "document"))
        loss = loss_fn(q, d)
        loss.backward()
        return float(loss.item())
    per_doc = max(1, micro * len(texts_d) // len(texts_q))
    plan = [
        (towers.query, "query", texts_q, _chunks(len(texts_q), micro)),
        (towers.document, "document", texts_d, _chunks(len(texts_d), per_doc)),
    ]
    cached: list[list[tuple[torch.Tensor, TokenBatch, torch.Tensor]]] = []
    for tower, kind, texts, chunks in plan:
        rows = []
        for part in chunks:
            batch = codec.encode(texts[part], kind)
            rng = torch.get_rng_state()
            with torch.no_grad():
                rows.append((rng, batch, _forward(tower, batch)))
        cached.append(rows)
    after = torch.get_rng_state()
    q = torch.cat([e for _, _, e in cached[0]]).requires_grad_()
    d = torch.cat([e for _, _, e in cached[1]]).requires_grad_()
    loss = loss_fn(q, d)
    loss.backward()
    for (tower, _, _, chunks), rows, grads in zip(plan, cached, (q.grad, d.grad), strict=True):
        assert grads is not None
        for part, (rng, batch, _) in zip(chunks, rows, strict=True):
            torch.set_rng_state(rng)
            _forward(tower, batch).backward(grads[part])
    torch.set_rng_state(after)
    return float(loss.item())


def _optimizer(towers: Towers, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay: list[torch.nn.Parameter] = []
    plain: list[torch.nn.Parameter] = []
    for name, p in towers.named_parameters():
        (plain if p.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(p)
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": plain, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
    )


def _schedule(opt: torch.optim.Optimizer, steps: int, warmup_fraction: float) -> Any:
    warmup = max(1, int(steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (steps - step) / max(1, steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


class DevPool:
    """nDCG@10 of the current towers on the dev queries, ranking a fixed document pool."""

    def __init__(self, td: TrainingData, ranks: dict[str, list[str]]) -> None:
        self.td = td
        pool = {d for q in td.dev_qids for d in ranks[q]}
        pool |= {d for q in td.dev_qids for d in td.data.qrels[q]}
        self.doc_ids = sorted(pool)

    @torch.no_grad()
    def ndcg(self, towers: Towers, codec: TextCodec, batch: int = 64) -> float:
        towers.train(False)
        try:
            data = self.td.data
            docs = torch.cat(
                [
                    _forward(
                        towers.document,
                        codec.encode(
                            [data.docs[d] for d in self.doc_ids[i : i + batch]], "document"
                        ),
                    )
                    for i in range(0, len(self.doc_ids), batch)
                ]
            )
            qs = torch.cat(
                [
                    _forward(
                        towers.query,
                        codec.encode(
                            [data.queries[q] for q in self.td.dev_qids[i : i + batch]], "query"
                        ),
                    )
                    for i in range(0, len(self.td.dev_qids), batch)
                ]
            )
            sims = (qs @ docs.T).numpy()
            top = np.argsort(-sims, axis=1, kind="stable")[:, :10]
            run = {q: [self.doc_ids[j] for j in top[r]] for r, q in enumerate(self.td.dev_qids)}
            return score(run, data.qrels, self.td.dev_qids).mean("ndcg_at_10")
        finally:
            towers.train(True)


def _codec(base: Path, cfg: TrainConfig) -> TextCodec:
    from tokenizers import Tokenizer

    spec = load_tokenizer_spec(base)
    limit = read_layout(base).max_seq_length
    lens = {"query": min(cfg.max_query_len, limit), "document": min(cfg.max_doc_len, limit)}
    return TextCodec(Tokenizer.from_str(spec.tokenizer_json), lens, spec.pad_id)


def _usage() -> dict[str, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_seconds": ru.ru_utime + ru.ru_stime, "peak_rss_mib": ru.ru_maxrss / 1024}


def train(cfg: TrainConfig) -> TrainResult:
    """Train (or resume) one architecture; write the checkpoint(s) and manifest to ``cfg.out``."""
    from tqdm import tqdm

    arch, base = validate(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    wall0, cpu0 = time.perf_counter(), _usage()["cpu_seconds"]
    torch.manual_seed(cfg.seed)
    td = load_training_data(cfg.data_dir, cfg.seed, cfg.dev_fraction)
    towers = build_towers(base, arch)
    dim = _dim(towers.query)
    if cfg.index_dir is not None:
        check_index_dim(dim, cfg.index_dir, f"the checkpoint {base}")
    codec = _codec(base, cfg)
    key = model_key(base)
    encode = LazyEncoder(base)
    mine0 = time.perf_counter()
    negatives = (
        mine_negatives(td, encode, key, cfg.negative_skip, cfg.negative_depth, cfg.progress)
        if cfg.negatives
        else {}
    )
    pool = (
        DevPool(td, base_ranks(td, td.dev_qids, encode, key, cfg.dev_pool_depth, cfg.progress))
        if cfg.eval_every
        else None
    )
    mine_seconds = time.perf_counter() - mine0
    del encode
    batches = Batches(td, negatives, cfg)
    opt = _optimizer(towers, cfg)
    sched = _schedule(opt, batches.steps, cfg.warmup_fraction)
    out = Path(cfg.out)
    start, losses, curve, trained_s = 0, [], [], 0.0
    if cfg.resume:
        state = torch.load(out / TRAINER_STATE, map_location="cpu", weights_only=False)
        if state["recipe"] != cfg.recipe() or state["arch"] != arch:
            raise FailedPrecondition(f"--resume: {out} was trained with another arch or recipe")
        towers.load_state_dict(state["towers"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        start, losses, curve = int(state["step"]), list(state["losses"]), list(state["curve"])
        trained_s = float(state["train_seconds"])
    towers.train(True)
    qrels = td.data.qrels
    bar = tqdm(
        range(start, batches.steps),
        initial=start,
        total=batches.steps,
        desc=f"train {arch}",
        disable=not cfg.progress,
    )
    seg = time.perf_counter()
    eval_s = 0.0
    for step in bar:
        qids, dids, _ = batches.step(step)
        texts_q = [td.data.queries[q] for q in qids]
        texts_d = [td.data.docs[d] for d in dids]

        def loss_fn(
            q: torch.Tensor, d: torch.Tensor, qids: list[str] = qids, dids: list[str] = dids
        ) -> torch.Tensor:
            return in_batch_loss(q, d, qids, dids, qrels, cfg.temperature)

        opt.zero_grad(set_to_none=True)
        losses.append(step_loss(towers, codec, texts_q, texts_d, loss_fn, cfg.micro_batch))
        torch.nn.utils.clip_grad_norm_(towers.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        done = step + 1
        bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
        if (
            pool is not None
            and done % cfg.eval_every == 0
            and (done < batches.steps or not cfg.final_eval)
        ):  # the last step's figure is the exact one (final_eval)
            e0 = time.perf_counter()
            curve.append({"step": done, "dev_pool_ndcg_at_10": round(pool.ndcg(towers, codec), 4)})
            eval_s += time.perf_counter() - e0
            log.info("step %d: dev pool nDCG@10 %.4f", done, curve[-1]["dev_pool_ndcg_at_10"])
        stop = cfg.stop_after is not None and done >= cfg.stop_after and done < batches.steps
        if stop or (
            cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < batches.steps
        ):
            elapsed = trained_s + time.perf_counter() - seg - eval_s
            _save_state(out, towers, opt, sched, cfg, arch, done, losses, curve, elapsed)
            save_towers(towers, base, out)
            write_manifest(
                out,
                _manifest(
                    cfg,
                    arch,
                    base,
                    td,
                    towers,
                    dim,
                    done,
                    batches.steps,
                    losses,
                    curve,
                    {},
                    {"train_seconds": elapsed},
                ),
            )
        if stop:
            bar.close()
            return TrainResult(out, json.loads((out / MANIFEST).read_text()))
    bar.close()
    train_seconds = trained_s + time.perf_counter() - seg - eval_s
    towers.train(False)
    save_towers(towers, base, out)
    (out / TRAINER_STATE).unlink(missing_ok=True)
    usage = _usage()
    timing = {
        "train_seconds": round(train_seconds, 1),
        "mine_seconds": round(mine_seconds, 1),
        "pool_eval_seconds": round(eval_s, 1),
        "wall_seconds": round(time.perf_counter() - wall0, 1),
        "cpu_seconds": round(usage["cpu_seconds"] - cpu0, 1),
        "peak_rss_mib": round(usage["peak_rss_mib"], 1),
        "threads": torch.get_num_threads(),
        "resumed": cfg.resume,
    }
    dev: dict[str, Any] = {}
    manifest = _manifest(
        cfg, arch, base, td, towers, dim, batches.steps, batches.steps, losses, curve, dev, timing
    )
    write_manifest(out, manifest)
    if cfg.final_eval:
        from services.encoder.train.evaluate import dev_metrics

        e0 = time.perf_counter()
        sample = eval_corpus(td, cfg.eval_corpus, cfg.seed)
        dev.update(dev_metrics(out, sample, cfg.progress, cfg.eval_doc_len))
        dev["eval_corpus"] = cfg.eval_corpus
        curve.append({"step": batches.steps, "dev_exact_ndcg_at_10": dev["ndcg_at_10"]})
        timing["dev_eval_seconds"] = round(time.perf_counter() - e0, 1)
        usage = _usage()
        timing["peak_rss_mib"] = round(usage["peak_rss_mib"], 1)
        manifest = _manifest(
            cfg,
            arch,
            base,
            td,
            towers,
            dim,
            batches.steps,
            batches.steps,
            losses,
            curve,
            dev,
            timing,
        )
        write_manifest(out, manifest)
    plot_curve(manifest, out / CURVE_PNG)
    return TrainResult(out, manifest)


def _dim(tower: DualEncoder) -> int:
    probe = torch.ones(1, 2, dtype=torch.long)
    with torch.no_grad():
        return int(tower(probe, probe).shape[-1])


def _save_state(
    out: Path,
    towers: Towers,
    opt: Any,
    sched: Any,
    cfg: TrainConfig,
    arch: str,
    step: int,
    losses: list[float],
    curve: list[dict[str, Any]],
    train_seconds: float,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {
        "towers": towers.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "step": step,
        "losses": losses,
        "curve": curve,
        "recipe": cfg.recipe(),
        "arch": arch,
        "train_seconds": train_seconds,
    }
    tmp = out / f"{TRAINER_STATE}.tmp"
    torch.save(state, tmp)
    tmp.replace(out / TRAINER_STATE)


def _manifest(
    cfg: TrainConfig,
    arch: Arch,
    base: Path,
    td: TrainingData,
    towers: Towers,
    dim: int,
    step: int,
    steps: int,
    losses: list[float],
    curve: list[dict[str, Any]],
    dev: dict[str, Any],
    timing: dict[str, Any],
) -> dict[str, Any]:
    return {
        "arch": arch,
        "complete": step >= steps,
        "towers": {"query": "query", "document": "document"}
        if is_asymmetric(arch)
        else {"query": ".", "document": "."},
        "added_projection": towers.added_projection,
        "dim": dim,
        "base_checkpoint": {
            "path": str(base),
            "name": model_name_of(base),
            "key": model_key(base),
        },
        "data": {
            "dir": str(cfg.data_dir),
            "split": "train",
            "digest": td.digest,
            "train_pairs": len(td.pairs),
        },
        "dev_split": {
            "seed": cfg.seed,
            "dev_fraction": cfg.dev_fraction,
            "train_queries": len(td.train_qids),
            "dev_queries": len(td.dev_qids),
            "dev_qids": td.dev_qids,
            "dev_qids_digest": ids_digest(td.dev_qids),
        },
        "steps": step,
        "total_steps": steps,
        "recipe": cfg.recipe(),
        "dev": dev,
        "curve": {"loss": [round(v, 5) for v in losses], "dev": curve},
        "timing": timing,
    }


def plot_curve(manifest: dict[str, Any], path: Path) -> None:
    """Training loss (moving mean over 10 steps) and dev pool nDCG@10, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = np.asarray(manifest["curve"]["loss"], dtype=float)
    fig, ax = plt.subplots(figsize=(7, 4))
    if loss.size:
        w = min(10, loss.size)
        smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
        ax.plot(np.arange(1, loss.size + 1), loss, color="0.8", lw=0.8, label="loss")
        ax.plot(np.arange(w, loss.size + 1), smooth, color="C0", label=f"loss (mean of {w})")
    ax.set_xlabel("step")
    ax.set_ylabel("in-batch softmax loss")
    dev = manifest["curve"]["dev"]
    if dev:
        ax2 = ax.twinx()
        pool = [p for p in dev if "dev_pool_ndcg_at_10" in p]
        exact = [p for p in dev if "dev_exact_ndcg_at_10" in p]
        if pool:
            ax2.plot(
                [p["step"] for p in pool],
                [p["dev_pool_ndcg_at_10"] for p in pool],
                "o-",
                color="C1",
                label="dev nDCG@10 (base top-k pool)",
            )
        if exact:
            ax2.plot(
                [p["step"] for p in exact],
                [p["dev_exact_ndcg_at_10"] for p in exact],
                "s",
                color="C3",
                label="dev nDCG@10 (exact, corpus)",
            )
        ax2.set_ylabel("dev nDCG@10")
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    ax.set_title(
        f"{manifest['arch']}: {manifest['steps']} steps, batch {manifest['recipe']['batch_size']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["ARCHS", "TrainConfig", "TrainResult", "read_manifest", "train"]
