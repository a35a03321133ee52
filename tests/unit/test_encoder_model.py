"""The PyTorch dual encoder against sentence-transformers (the reference implementation)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from services.common.errors import InvalidArgument, NotFound
from services.encoder.build.export import row_cosines
from services.encoder.model import (
    DualEncoder,
    default_model_dir,
    load_dual_encoder,
    model_name_of,
    read_layout,
)
from tests.encoder_fixtures import (
    SAMPLE_DOCUMENTS,
    SAMPLE_QUERIES,
    TINY_T5_DIM,
    encoder_base,
    ensure_tiny_t5,
    torch_embedder,
)


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_t5(encoder_base(tmp_path_factory))


def _reference(model_dir: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    return np.asarray(model.encode(texts, batch_size=len(texts), convert_to_numpy=True))


def test_tiny_t5_has_the_gtr_layout(t5_dir: Path) -> None:
    layout = read_layout(t5_dir)
    assert layout.pooling == "mean" and layout.normalize
    assert layout.dense is not None and not layout.dense.bias
    assert layout.dense.activation.endswith("Identity")
    module = load_dual_encoder(t5_dir)
    assert isinstance(module, DualEncoder)
    assert type(module.backbone).__name__ == "T5EncoderModel"  # encoder only, no decoder


@pytest.mark.parametrize("which", ["minilm", "tiny-t5"])
def test_matches_sentence_transformers(which: str, t5_dir: Path) -> None:
    model_dir = default_model_dir() if which == "minilm" else t5_dir
    texts = SAMPLE_QUERIES + SAMPLE_DOCUMENTS
    ours, truncated = torch_embedder(model_dir).embed(texts, "document")
    assert truncated == [False] * len(texts)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert min(row_cosines(ours, _reference(model_dir, texts))) >= 0.9999


def test_dims_and_names(t5_dir: Path) -> None:
    minilm = torch_embedder(default_model_dir())
    assert (minilm.dim, minilm.model_name) == (384, "all-MiniLM-L6-v2")
    assert minilm.profile.name == "minilm"
    tiny = torch_embedder(t5_dir)
    assert (tiny.dim, tiny.model_name, tiny.profile.family) == (TINY_T5_DIM, "tiny-gtr-t5", "t5")
    assert tiny.codec.max_lens == {"query": 64, "document": 512}
    assert model_name_of(t5_dir) == "tiny-gtr-t5"


def test_padding_does_not_change_an_embedding(t5_dir: Path) -> None:
    embedder = torch_embedder(t5_dir)
    alone, _ = embedder.embed(["x"], "query")
    padded, _ = embedder.embed(["x", SAMPLE_DOCUMENTS[2]], "query")
    assert row_cosines(alone, padded[:1])[0] >= 0.99999


def test_long_documents_are_truncated_and_flagged() -> None:
    embedder = torch_embedder(default_model_dir())
    vectors, truncated = embedder.embed(["word " * 400, "short"], "document")
    assert truncated == [True, False] and vectors.shape == (2, 384)
    query = embedder.tokenize(["word " * 400], "query")
    assert query.input_ids.shape[1] == 64


def test_dense_weights_are_used(t5_dir: Path, tmp_path: Path) -> None:
    """A checkpoint without its Dense gives different vectors: the projection is applied."""
    copy = tmp_path / "no-dense"
    shutil.copytree(t5_dir, copy)
    modules = [m for m in json.loads((copy / "modules.json").read_text()) if m["path"] != "2_Dense"]
    (copy / "modules.json").write_text(json.dumps(modules))
    with_dense, _ = torch_embedder(t5_dir).embed(SAMPLE_QUERIES, "query")
    from services.encoder.model import TorchEmbedder

    without, _ = TorchEmbedder(copy).embed(SAMPLE_QUERIES, "query")
    assert max(row_cosines(with_dense, without)) < 0.99


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match=r"modules\.json"):
        read_layout(tmp_path)


def test_unsupported_module_is_refused(t5_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "odd"
    shutil.copytree(t5_dir, copy)
    modules = json.loads((copy / "modules.json").read_text())
    lstm = "sentence_transformers.models.LSTM"
    modules.append({"idx": 9, "name": "9", "path": "x", "type": lstm})
    (copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(InvalidArgument, match="LSTM"):
        read_layout(copy)


@pytest.mark.slow
def test_reproduces_the_shared_scifact_embeddings(scifact_dir: Path) -> None:
    """The index is built from corpus.all-MiniLM-L6-v2.npy: our documents must land on it."""
    docs = []
    with (scifact_dir / "corpus.jsonl").open() as f:
        for line, _ in zip(f, range(24), strict=False):
            doc = json.loads(line)
            docs.append(f"{doc['title']} {doc['text']}")
    reference = np.load(scifact_dir / "corpus.all-MiniLM-L6-v2.npy", mmap_mode="r")[: len(docs)]
    ours, _ = torch_embedder(default_model_dir()).embed(docs, "document")
    assert min(row_cosines(ours, np.asarray(reference))) >= 0.9999
