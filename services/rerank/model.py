"""CELI: Cross-Encoder with Late Interaction (Zhang, Li, Lin), on any HF encoder backbone.

One joint encoding of ``[CLS] q [SEP] d [SEP]`` gives final-layer token vectors ``T``.

* ``s_m = T_[CLS] · W_m + b_m``: the monoBERT head.
* ``v = T · W + b`` for every token (``W ∈ R^{D×D_tok}``, ``b ∈ R^{D_tok}``);
  ``s_l = Σ_{i ∈ q} max_{j ∈ d} v_i · v_j`` over the *real* tokens of each segment
  (no [CLS], no [SEP], no padding). A segment with no real token contributes 0.
* ``score = s_m + s_l``.

Option ``normalize`` (default of new checkpoints, as in ColBERT): ``v`` is scaled to
unit length before MaxSim, so ``s_l`` is a sum of cosines. Off, it is the formula
verbatim. On this backbone (a sentence-embedding model trained on cosines) the
normalised MaxSim of the untrained joint encoding already ranks SciFact close to the
dense first stage, while the unnormalised dot product is dominated by a few large
dimensions (see docs/rerank.md).

Variants, for comparison: ``monobert`` (``score = s_m``, no projection) and
``meanpool`` (``s_l = mean_q(v) · mean_d(v)``, the late term with mean pooling instead
of MaxSim). Everything is batched tensor algebra: no Python loop over pairs or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

Variant = Literal["celi", "monobert", "meanpool"]
VARIANTS: tuple[Variant, ...] = ("celi", "monobert", "meanpool")
_NEG = -1e4  # masked similarity; finite so that 0 * _NEG stays 0 in the backward pass


@dataclass(frozen=True)
class CeliScores:
    """Per-pair scores, each of shape ``(batch,)``."""

    s_m: torch.Tensor
    s_l: torch.Tensor
    score: torch.Tensor


@dataclass(frozen=True)
class SpecialIds:
    """Token ids that delimit segments (never scored by ``s_l``)."""

    cls: int | None
    sep: int
    pad: int
    extra: tuple[int, ...] = ()  # e.g. BOS/EOS of RoBERTa-like tokenizers

    def all(self) -> list[int]:
        return sorted({i for i in (self.cls, self.sep, self.pad, *self.extra) if i is not None})


def segment_masks(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    special: SpecialIds,
    token_type_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean ``(batch, len)`` masks of the real query tokens and the real doc tokens.

    With ``token_type_ids`` (BERT-style backbones), the segments are type 0 and type 1;
    without them, the query is everything before the first [SEP] and the document
    everything after it. Position 0 ([CLS]/BOS), every structural special token and
    padding are excluded in both cases.
    """
    specials = torch.tensor(special.all(), device=input_ids.device, dtype=input_ids.dtype)
    real = attention_mask.bool() & ~torch.isin(input_ids, specials)
    real[:, 0] = False
    if token_type_ids is not None and bool((token_type_ids > 0).any()):
        return real & (token_type_ids == 0), real & (token_type_ids > 0)
    is_sep = (input_ids == special.sep) & attention_mask.bool()
    seps_before = torch.cumsum(is_sep.long(), dim=1) - is_sep.long()
    return real & (seps_before == 0), real & (seps_before > 0)


def maxsim(v: torch.Tensor, q_mask: torch.Tensor, d_mask: torch.Tensor) -> torch.Tensor:
    """``Σ_{i∈q} max_{j∈d} v_i·v_j`` per row; rows without doc tokens score 0.

    Only the leading positions that can hold query tokens are used as rows, so the
    similarity matrix is ``(batch, q_len, len)`` rather than ``(batch, len, len)``.
    """
    q_rows = int(q_mask.any(0).nonzero().max().item()) + 1 if bool(q_mask.any()) else 1
    vq = v[:, :q_rows]
    sim = torch.einsum("bik,bjk->bij", vq, v)
    sim = sim.masked_fill(~d_mask[:, None, :], _NEG)
    best = sim.max(dim=2).values
    has_doc = d_mask.any(dim=1, keepdim=True)
    best = torch.where(has_doc, best, torch.zeros_like(best))
    return (best * q_mask[:, :q_rows].to(best.dtype)).sum(dim=1)


def meanpool_sim(v: torch.Tensor, q_mask: torch.Tensor, d_mask: torch.Tensor) -> torch.Tensor:
    """``mean_{i∈q} v_i · mean_{j∈d} v_j``; an empty segment pools to the zero vector."""

    def pool(mask: torch.Tensor) -> torch.Tensor:
        w = mask.to(v.dtype).unsqueeze(-1)
        return (v * w).sum(1) / w.sum(1).clamp(min=1.0)

    return (pool(q_mask) * pool(d_mask)).sum(-1)


class CeliHead(nn.Module):
    """The parameters CELI adds to the backbone: ``W_m, b_m`` and (not monoBERT) ``W, b``."""

    def __init__(self, hidden: int, d_tok: int, variant: Variant, normalize: bool = False) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if d_tok < 1:
            raise ValueError("d_tok must be >= 1")
        self.variant = variant
        self.normalize = normalize
        self.mono = nn.Linear(hidden, 1)
        self.proj: nn.Linear | None = None if variant == "monobert" else nn.Linear(hidden, d_tok)


class CeliModel(nn.Module):
    """Backbone + head: ``(input_ids, attention_mask, token_type_ids) -> CeliScores``."""

    def __init__(self, backbone: nn.Module, head: CeliHead, special: SpecialIds) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.special = special
        cfg = getattr(backbone, "config", None)
        self.uses_token_types = int(getattr(cfg, "type_vocab_size", 0) or 0) > 1

    @property
    def variant(self) -> Variant:
        return self.head.variant

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> CeliScores:
        kwargs: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None and self.uses_token_types:
            kwargs["token_type_ids"] = token_type_ids
        hidden = self.backbone(**kwargs)[0]
        s_m = self.head.mono(hidden[:, 0]).squeeze(-1)
        if self.head.proj is None:
            return CeliScores(s_m, torch.zeros_like(s_m), s_m)
        types = token_type_ids if self.uses_token_types else None
        q_mask, d_mask = segment_masks(input_ids, attention_mask, self.special, types)
        v = self.head.proj(hidden)
        if self.head.normalize:
            v = nn.functional.normalize(v, dim=-1)
        late = maxsim if self.head.variant == "celi" else meanpool_sim
        s_l = late(v, q_mask, d_mask)
        return CeliScores(s_m, s_l, s_m + s_l)


def init_for_training(head: CeliHead) -> None:
    """Start training from a neutral ``s_m`` and a length-preserving projection.

    ``W_m, b_m = 0``: an untrained [CLS] head adds noise to every score; at zero it
    starts neutral and grows only as far as LCE finds signal. ``W`` orthogonal,
    ``b = 0``: the projected token vectors keep the backbone's geometry as far as
    ``D_tok`` dimensions allow.
    """
    with torch.no_grad():
        nn.init.zeros_(head.mono.weight)
        nn.init.zeros_(head.mono.bias)
        if head.proj is not None:
            nn.init.orthogonal_(head.proj.weight)
            nn.init.zeros_(head.proj.bias)


def lce_loss(scores: torch.Tensor, group: int) -> torch.Tensor:
    """Localized contrastive estimation: rows of ``group`` scores, the positive first."""
    logits = scores.view(-1, group)
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return nn.functional.cross_entropy(logits, target)


def training_loss(out: CeliScores, group: int, variant: Variant) -> torch.Tensor:
    """``LCE(s_m) + LCE(s_l)`` (CELI, meanpool); ``LCE(s_m)`` for monoBERT."""
    loss = lce_loss(out.s_m, group)
    if variant != "monobert":
        loss = loss + lce_loss(out.s_l, group)
    return loss
