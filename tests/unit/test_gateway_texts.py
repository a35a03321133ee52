"""Documents are cut to what the encoder reads before they leave the gateway (issue #11).

The cut must not change the embedding: the model reads the same first tokens from the
cut text as from the whole one. Checked with the real tokenizer of the default model
and with the real model (through a recording encoder: the real one underneath).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pytest
import redis
from tokenizers import Tokenizer

from services.encoder.base import Embeddings
from services.encoder.model import TorchEmbedder
from services.encoder.runtime.inprocess import InProcessEncoder
from services.encoder.texts import MAX_CHARS_PER_TOKEN, MAX_DOCUMENT_TOKENS, cut_for_encoder
from services.gateway.document_pipeline import DocumentPipeline
from services.gateway.domain import Document
from services.gateway.generation_parts import Bundle
from services.gateway.generations import GenerationSource
from services.index.changelog import decode_entry
from services.index.client.documents import DocumentReader
from services.index.client.writer import ChangeLogWriter
from services.index.keys import log_key


@pytest.fixture(scope="module")
def embedder() -> TorchEmbedder:
    return TorchEmbedder(threads=1)


def _texts() -> list[str]:
    rng = random.Random(7)
    vocab = ["cell", "protein", "p53-mediated", "α-synuclein", "(n=42)", "x" * 150, "，", "——"]
    texts = [" ".join(rng.choice(vocab) for _ in range(n)) for n in (10, 300, 600, 5000)]
    texts.append("word " * 100 + " " * 50_000 + "tail " * 1000)  # a long run of spaces
    texts.append("a" * 200_000)  # one huge word
    texts.append("\n\n".join(["para graph"] * 20_000))
    return texts


@pytest.mark.parametrize("max_tokens", [64, 256, MAX_DOCUMENT_TOKENS])
def test_the_cut_keeps_every_token_the_model_reads(embedder: TorchEmbedder, max_tokens: int):
    base = Tokenizer.from_str(embedder.tokenizer_spec.tokenizer_json)
    base.no_truncation()
    for text in _texts():
        cut, was_cut = cut_for_encoder(text, max_tokens)
        assert len("".join(cut.split())) <= max_tokens * MAX_CHARS_PER_TOKEN
        assert text.startswith(cut) and was_cut == (cut != text)
        whole = base.encode(text, add_special_tokens=False).ids[:max_tokens]
        assert base.encode(cut, add_special_tokens=False).ids[:max_tokens] == whole


def test_upserts_send_the_encoder_only_what_it_reads(
    embedder: TorchEmbedder, redis_url: str
) -> None:
    """A 1 MiB document: the encoder (the real model, recorded) gets at most the cut, the
    store keeps it whole, and the logged vector is the whole text's embedding."""

    class Recording(InProcessEncoder):
        seen: ClassVar[list[str]] = []

        async def encode(
            self, texts: Sequence[str], kind: str, timeout: float | None = None
        ) -> Embeddings:
            self.seen.extend(texts)
            return await super().encode(texts, kind, timeout)  # type: ignore[arg-type]

    text = ("Mycobacterium tuberculosis persists in macrophages. " * 25_000)[: 1 << 20]
    encoder = Recording(embedder)

    async def run() -> int:
        writer = ChangeLogWriter.connect(redis_url, num_shards=1, dim=embedder.dim)
        documents = DocumentReader(writer.connection)
        try:
            parts = Bundle("g1", encoder, None, documents, None, writer)  # type: ignore[arg-type]
            pipeline = DocumentPipeline(GenerationSource.fixed(parts))
            result = await pipeline.upsert([Document("d", text)], timeout=60)
            stored = await documents.get_many(["d"])
            assert stored[0] is not None and stored[0].text == text
            return result.truncated
        finally:
            await writer.close()

    assert asyncio.run(run()) == 1
    assert max(len(t) for t in encoder.seen) <= MAX_DOCUMENT_TOKENS * MAX_CHARS_PER_TOKEN
    client = redis.Redis.from_url(redis_url)
    entries: Any = client.xrange(log_key(0))
    client.close()
    (change,) = decode_entry(entries[0][1])
    whole, _ = embedder.embed([text], "document")
    np.testing.assert_allclose(change.vector, whole[0], atol=1e-5)  # type: ignore[union-attr]
