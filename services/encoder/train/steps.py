"""One training step: the batch of a step, the loss, its backward pass, the optimiser.

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

Everything sampled is derived from ``(seed, step)`` (:class:`Batches`), so a run resumed
from its trainer state sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from services.encoder.model import DualEncoder
from services.encoder.textcodec import TextCodec, TokenBatch
from services.encoder.train.config import TrainConfig
from services.encoder.train.data import TrainingData
from services.encoder.train.towers import Towers


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


def forward(tower: DualEncoder, batch: TokenBatch) -> torch.Tensor:
    """``tower``'s embeddings of a tokenized batch."""
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
        q = forward(towers.query, codec.encode(texts_q, "query"))
        d = forward(towers.document, codec.encode(texts_d, "document"))
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
                rows.append((rng, batch, forward(tower, batch)))
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
            forward(tower, batch).backward(grads[part])
    torch.set_rng_state(after)
    return float(loss.item())


def optimizer(towers: Towers, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and layer norms."""
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


def schedule(opt: torch.optim.Optimizer, steps: int, warmup_fraction: float) -> Any:
    """Linear warm-up over ``warmup_fraction`` of the steps, then linear decay to 0."""
    warmup = max(1, int(steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (steps - step) / max(1, steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
