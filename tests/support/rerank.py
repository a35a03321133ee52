"""A tiny CELI checkpoint for tests that need a real rerank service: a BERT backbone of a
few words built in the test, the CELI head on it, saved as the trainer saves."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# The stdlib-like words the gateway's rerank tests search with.
WORDS = ["file", "read", "json", "csv", "thread", "pool", "hash", "bytes", "list", "row"]


def tiny_checkpoint(base: Path, words: Sequence[str] = WORDS) -> Path:
    from services.rerank.checkpoint import CeliConfig, build_model, save_checkpoint
    from services.rerank.tiny import write_tiny_backbone

    cfg = CeliConfig(max_len=48, max_query_len=8, d_tok=4)
    model, tok = build_model(write_tiny_backbone(base / "bert", list(words), seed=4), cfg, seed=9)
    return save_checkpoint(model, tok, cfg, base / "ckpt")
