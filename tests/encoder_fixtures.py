"""Test models for the encoder: a tiny GTR-layout T5 built from scratch, and caches.

No model hub is reachable, so the GTR code path is tested on a T5 that has the real
GTR sentence-transformers layout (T5 encoder, mean pooling, 2_Dense without bias and
with identity activation, Normalize) and a real sentencepiece vocabulary trained here
on stdlib docstrings. Random weights are fine: the tests compare implementations of
the same function (ours vs. sentence-transformers, PyTorch vs. ONNX vs. Triton).

Everything is built once per test session under pytest's base temp dir and reused
by every module (``ensure_*`` functions are idempotent and lock-free: one process).
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from services.encoder.model import TorchEmbedder

TINY_T5_DIM = 48
_STDLIB_MODULES = (
    "os",
    "json",
    "re",
    "pathlib",
    "collections",
    "functools",
    "itertools",
    "string",
    "textwrap",
    "argparse",
    "logging",
    "subprocess",
    "shutil",
    "tempfile",
    "random",
)


def _corpus_lines() -> list[str]:
    lines: list[str] = []
    for name in _STDLIB_MODULES:
        module = importlib.import_module(name)
        for obj in [module, *vars(module).values()]:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            if doc:
                lines.extend(line.strip() for line in doc.splitlines() if len(line.strip()) > 20)
    return sorted(set(lines))


def build_tiny_t5(root: Path, seed: int = 0) -> Path:
    """Write a GTR-layout sentence-transformers checkpoint with a tiny random T5."""
    import sentencepiece as spm
    import torch
    from safetensors.torch import save_file
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    root.mkdir(parents=True, exist_ok=True)
    prefix = root / "_spm"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus_lines()),
        model_prefix=str(prefix),
        vocab_size=600,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        minloglevel=2,
    )
    # transformers' own spiece.model converter needs a newer protobuf than the one pinned
    # here, so the fast tokenizer is built from the trained pieces and scores instead.
    sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.model_max_length = 512
    tokenizer.save_pretrained(str(root))
    Path(str(prefix) + ".model").rename(root / "spiece.model")  # as in real GTR checkpoints
    Path(str(prefix) + ".vocab").unlink()

    torch.manual_seed(seed)
    config = T5Config(  # type: ignore[call-arg]
        vocab_size=len(tokenizer),
        d_model=TINY_T5_DIM,
        d_kv=12,
        d_ff=96,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="relu",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    T5EncoderModel(config).eval().save_pretrained(str(root))

    (root / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 512, "do_lower_case": False})
    )
    (root / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Dense",
                    "type": "sentence_transformers.models.Dense",
                },
                {
                    "idx": 3,
                    "name": "3",
                    "path": "3_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (root / "1_Pooling").mkdir(exist_ok=True)
    (root / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": TINY_T5_DIM,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": True,
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
            }
        )
    )
    dense_dir = root / "2_Dense"
    dense_dir.mkdir(exist_ok=True)
    (dense_dir / "config.json").write_text(
        json.dumps(
            {
                "in_features": TINY_T5_DIM,
                "out_features": TINY_T5_DIM,
                "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity",
            }
        )
    )
    weight = torch.randn(TINY_T5_DIM, TINY_T5_DIM, generator=torch.Generator().manual_seed(seed))
    save_file(
        {"linear.weight": (weight / TINY_T5_DIM**0.5).contiguous()},
        str(dense_dir / "model.safetensors"),
    )
    (root / "3_Normalize").mkdir(exist_ok=True)
    return root


def ensure_tiny_t5(base: Path) -> Path:
    """The session's tiny T5 checkpoint (built on first use)."""
    root = base / "tiny-gtr-t5"
    if not (root / "modules.json").exists():
        build_tiny_t5(root)
    return root


TINY_BERT_DIM = 32


def build_tiny_bert(root: Path, seed: int = 0) -> Path:
    """A tiny random BERT in all-MiniLM-L6-v2's layout (no Dense layer), its tokenizer."""
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    from services.encoder.model import default_model_dir

    root.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy2(default_model_dir() / name, root / name)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=TINY_BERT_DIM,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    BertModel(config, add_pooling_layer=False).eval().save_pretrained(str(root))
    (root / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 128, "do_lower_case": False})
    )
    (root / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (root / "1_Pooling").mkdir(exist_ok=True)
    (root / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": TINY_BERT_DIM,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": True,
            }
        )
    )
    return root


def ensure_tiny_bert(base: Path) -> Path:
    """The session's tiny BERT checkpoint (MiniLM layout; built on first use)."""
    root = base / "tiny-bert"
    if not (root / "modules.json").exists():
        build_tiny_bert(root)
    return root


def write_beir(root: Path, queries: int = 24, docs: int = 60) -> Path:
    """A BEIR folder from stdlib docstrings: query i = the first words of document i."""
    lines = _corpus_lines()[:docs]
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    with (root / "corpus.jsonl").open("w") as fh:
        for i, line in enumerate(lines):
            fh.write(json.dumps({"_id": f"d{i}", "title": "", "text": line}) + "\n")
    with (root / "queries.jsonl").open("w") as fh:
        for i in range(queries):
            fh.write(json.dumps({"_id": f"q{i}", "text": " ".join(lines[i].split()[:5])}) + "\n")
    with (root / "qrels" / "train.tsv").open("w") as fh:
        fh.write("query-id\tcorpus-id\tscore\n")
        for i in range(queries):
            fh.write(f"q{i}\td{i}\t1\n")
    return root


def ensure_onnx(model_dir: Path, base: Path) -> Path:
    """The session's ONNX export of ``model_dir`` (exported on first use)."""
    from services.encoder.build.export import export_onnx
    from services.encoder.model import model_name_of

    out = base / "onnx" / model_name_of(model_dir) / "model.onnx"
    if not out.exists():
        export_onnx(model_dir, out)
    return out


SAMPLE_QUERIES = [
    "what is a dual encoder",
    "how do I read a json file",
    "temporary directory cleanup",
    "x",
]
SAMPLE_DOCUMENTS = [
    "Return a new path with expanded ~ and ~user constructs, as returned by os.path.",
    "The json module exposes an API familiar to users of the standard library marshal "
    "and pickle modules. Deserialize a str instance containing a JSON document.",
    "Create and return a temporary directory. This has the same behavior as mkdtemp but "
    "can be used as a context manager; on exit the directory and its contents are removed.",
]


def encoder_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder per test session shared by every encoder test module."""
    base = tmp_path_factory.getbasetemp() / "encoder"
    base.mkdir(parents=True, exist_ok=True)
    return base


_EMBEDDERS: dict[str, TorchEmbedder] = {}


def torch_embedder(model_dir: Path) -> TorchEmbedder:
    """A cached :class:`TorchEmbedder` per checkpoint (loading MiniLM costs ~1 s)."""
    from services.encoder.model import TorchEmbedder

    key = str(Path(model_dir).resolve())
    if key not in _EMBEDDERS:
        _EMBEDDERS[key] = TorchEmbedder(model_dir)
    return _EMBEDDERS[key]


def mixed_lengths(n: int = 24) -> list[str]:
    """Distinct documents of very different lengths, interleaved, each length a little
    shorter every time it comes round (the longest truncated): sorted by length, the rows
    of a piece are not in the request's order."""
    words = [f"word{i}" for i in range(600)]
    sizes = [1, 60, 3, 400, 8, 25]
    return [" ".join(words[row : row + max(1, sizes[row % 6] - row // 6)]) for row in range(n)]
