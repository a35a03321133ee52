"""Which SCANned documents a rollout's bulk pass leaves to the catch-up: those whose last
write (their hash's ``lid``) is logged after their shard's P0 position."""

from __future__ import annotations

from services.generations.documents import written_since
from services.index.keys import GenerationKeys, Layout


def test_only_a_document_logged_after_its_shards_p0_is_left_to_the_catch_up() -> None:
    keys = GenerationKeys("g1", Layout(2, 2))
    ids = [f"d{i}" for i in range(40)]
    p0 = {0: "1000-5", 1: "2000-0"}
    lids = {
        doc_id: (b"1000-6", b"1000-5", b"999-9")[i % 3]
        if keys.layout.shard(doc_id) == 0
        else (b"2000-1", b"2000-0", b"3-0")[i % 3]
        for i, doc_id in enumerate(ids)
    }
    docs = [(doc_id, {b"ver": b"1", b"lid": lids[doc_id]}) for doc_id in ids]
    late = {doc_id for doc_id, _ in written_since(docs, keys, p0)}
    assert late == {doc_id for doc_id in ids if lids[doc_id] in (b"1000-6", b"2000-1")}
    assert late and len(late) < len(ids)


def test_without_a_logged_entry_or_a_p0_position_a_document_is_encoded() -> None:
    keys = GenerationKeys("g1", Layout(2, 2))
    docs = [("a", {b"ver": b"1"}), ("b", {b"ver": b"1", b"lid": b"9999-0"})]
    assert written_since(docs, keys, {0: "1-0", 1: "1-0"}) == [docs[1]]
    assert written_since(docs, keys, {}) == []  # no P0 recorded: nothing is skipped
