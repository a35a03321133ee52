"""A tiny random BERT backbone + word-level vocab, for tests and smoke runs (no download)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def write_tiny_backbone(
    out: Path,
    words: Iterable[str],
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    max_positions: int = 512,
) -> Path:
    """Write ``config.json``, weights and a WordPiece vocab of ``words`` to ``out``."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = list(SPECIALS) + sorted({w.lower() for w in words} - set(SPECIALS))
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=max_positions,
        type_vocab_size=2,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
