"""The FP32 document vectors the int8 quality gates compare against: a cached
``corpus.<model>.npy`` counts only when it holds this very model's vectors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.corpus.beir import load_beir
from services.encoder.build.export import EncoderMeta, onnx_session, row_cosines
from services.encoder.build.int8_quality import embed_texts, export_codec, fp32_document_vectors
from tests.encoder_fixtures import encoder_base, ensure_onnx, ensure_tiny_t5, write_beir


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = encoder_base(tmp_path_factory)
    return ensure_onnx(ensure_tiny_t5(base), base)


def _corpus(export: Path, root: Path) -> tuple[Path, list[str], list[str], np.ndarray]:
    beir = write_beir(root / "beir", queries=4, docs=20)
    data = load_beir(beir)
    texts = [data.docs[d] for d in data.doc_ids]
    codec = export_codec(export.parent)
    graph = embed_texts(onnx_session(export, 1), codec, texts, "document")
    return beir, data.doc_ids, texts, graph


def test_a_cache_of_this_models_vectors_is_used(export: Path, tmp_path: Path) -> None:
    beir, ids, texts, graph = _corpus(export, tmp_path)
    cached = graph.copy()
    cached[-1] = -cached[-1]  # a row the probes do not read: proves the cache was taken
    np.save(beir / f"corpus.{EncoderMeta.read(export.parent).model_name}.npy", cached)
    got = fp32_document_vectors(export, beir, ids, texts)
    np.testing.assert_array_equal(got, cached)


def test_a_cache_of_another_models_vectors_under_its_name_is_not(
    export: Path, tmp_path: Path
) -> None:
    """A checkpoint fine-tuned in a folder of the same name: the cache's shape fits, its
    vectors are another model's."""
    beir, ids, texts, graph = _corpus(export, tmp_path)
    other = np.random.default_rng(0).standard_normal(graph.shape).astype(np.float32)
    np.save(beir / f"corpus.{EncoderMeta.read(export.parent).model_name}.npy", other)
    got = fp32_document_vectors(export, beir, ids, texts)
    assert min(row_cosines(got, graph)) >= 0.9999
