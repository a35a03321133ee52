"""The BM25 text index of a shard: Tantivy segments on disk beside the vectors.

One Tantivy document per indexed document: ``fid`` (the 63-bit FAISS id of
:mod:`services.index.core.ids`, indexed and a fast field) and ``body`` (title + " " +
text, the BEIR convention the encoder also sees), analysed by Tantivy's own tokenizer
and stemmer: the simple tokenizer, tokens over 40 bytes dropped, lowercase, Snowball
stemmer of the configured language (``english`` = Tantivy's ``en_stem``; ``none``
stems nothing). Only term frequencies are indexed (no positions: BM25 needs none).

A query is analysed by the same analyzer (at most :data:`MAX_QUERY_TERMS` distinct
words before stemming, as the gateway counts them: :mod:`services.common.terms`), its
distinct terms become a disjunction of term queries scored by Tantivy's BM25
(k1 1.2, b 0.75). Not Tantivy's query parser: a user's ``:``, ``(`` or ``-`` would be
syntax there. Measured on SciFact train (809 queries, 5,183 documents): one ``body``
field with distinct terms nDCG@10 0.702 / Recall@100 0.926; the same with repeated
terms 0.696; separate title and text fields 0.675; the query parser 0.663 (0.641 on two
fields). Indexing 5,183 documents takes 0.4 s; 242 bytes per document on disk.

Writes (:meth:`TextIndex.apply`) are one Tantivy commit per applied log batch, and the
reader is reloaded before the call returns, so what the shard reports as applied is
searchable in both indexes. An upsert deletes the ``fid`` term and adds the new
document in the same commit (Tantivy applies a delete to the documents added before
it only). The live directory is a working copy: durability comes from the shard's
snapshots, which carry the index's files (:meth:`export_files`) and are restored into
a fresh directory (:meth:`TextIndex.restore`), then the log is replayed from the
snapshot's position into both indexes.

No grpc, no Redis: :class:`services.index.core.shard.IvfPqShard` owns one and keeps it
in step with its vectors under the same lock.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tantivy

from services.common.errors import FailedPrecondition
from services.common.limits import LIMITS
from services.common.terms import MAX_TOKEN_BYTES, check_query_terms

log = logging.getLogger(__name__)

MAX_QUERY_TERMS = LIMITS.max_query_terms
# MAX_TOKEN_BYTES (services.common.terms): Tantivy's en_stem drops longer tokens
WRITER_HEAP_BYTES = 32_000_000  # Tantivy's floor is 15 MB per indexing thread
META = "meta.json"
OWN_META = "gtr-text.json"  # ours, beside Tantivy's files: how the text was analysed
# Snowball stemmers Tantivy ships (tantivy-stemmers' Language); "none": no stemming.
LANGUAGES = (
    "arabic",
    "danish",
    "dutch",
    "english",
    "finnish",
    "french",
    "german",
    "greek",
    "hungarian",
    "italian",
    "norwegian",
    "portuguese",
    "romanian",
    "russian",
    "spanish",
    "swedish",
    "tamil",
    "turkish",
    "none",
)


def check_language(language: str) -> str:
    if language not in LANGUAGES:
        raise ValueError(f"text language {language!r}: one of {', '.join(LANGUAGES)}")
    return language


def analyzer(language: str) -> tantivy.TextAnalyzer:
    """The analyzer of documents and queries (``english`` is Tantivy's ``en_stem``)."""
    builder = (
        tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
        .filter(tantivy.Filter.remove_long(MAX_TOKEN_BYTES))
        .filter(tantivy.Filter.lowercase())
    )
    if check_language(language) != "none":
        builder = builder.filter(tantivy.Filter.stemmer(language))
    return builder.build()


def _schema() -> tantivy.Schema:
    builder = tantivy.SchemaBuilder()
    builder.add_integer_field("fid", indexed=True, fast=True)
    builder.add_text_field("body", tokenizer_name="gtr", index_option="freq")
    builder.add_text_field("tag", tokenizer_name="raw", index_option="basic")
    return builder.build()


def tag_term(key: str, value: str) -> str:
    """A metadata condition as one raw term of the ``tag`` field (filters)."""
    return f"{key}\x1f{value}"


@dataclass(frozen=True)
class TextConfig:
    """Where a shard keeps its text index (working directories under ``root``) and how
    it analyses text."""

    root: Path
    language: str = "english"


@dataclass(frozen=True)
class TextDoc:
    fid: int
    body: str
    tags: Mapping[str, str]


@dataclass(frozen=True)
class TextStats:
    documents: int
    segments: int
    disk_bytes: int | None  # None: the working directory could not be read


@dataclass(frozen=True)
class TextHits:
    """Per query row, the FAISS ids and BM25 scores of its hits, best first (``-1`` /
    ``-inf`` pad a row with fewer hits)."""

    fids: np.ndarray  # (rows, k) int64
    scores: np.ndarray  # (rows, k) float32


class TextIndex:
    """``TextIndex.create(root, language)`` (empty) or ``TextIndex.restore(root, files)``.

    Each instance works in a directory of its own under ``root`` (``live-<pid>-<n>``):
    a replica that loads another snapshot (seeding) never shares one with the index it
    replaces; what a previous process left there is removed by the next create or restore.
    """

    def __init__(self, directory: Path, language: str, index: tantivy.Index) -> None:
        self.directory = directory
        self.language = check_language(language)
        self._analyzer = analyzer(language)
        self._index = index
        self._index.register_tokenizer("gtr", analyzer(language))
        self._schema = self._index.schema
        self._writer: tantivy.IndexWriter | None = self._index.writer(WRITER_HEAP_BYTES, 1)
        self._searcher = self._index.searcher()
        self._export_lock = threading.Lock()
        self.pending = False  # changes staged in the writer and not yet committed

    @classmethod
    def create(cls, root: Path, language: str = "english") -> TextIndex:
        """An empty index in a new directory under ``root``."""
        check_language(language)
        directory = _fresh(root)
        return cls(directory, language, tantivy.Index(_schema(), path=str(directory)))

    @classmethod
    def restore(
        cls, root: Path, files: Mapping[str, bytes], language: str = "english"
    ) -> TextIndex:
        """The index whose files :meth:`export_files` gave, in a new directory under ``root``.

        FailedPrecondition when they were built with another language than ``language``
        (the terms would not match the queries' analysis)."""
        meta = json.loads(files[OWN_META])
        if meta["language"] != language:
            raise FailedPrecondition(
                f"the snapshot's text index was analysed as {meta['language']!r}, this "
                f"replica is configured for {language!r}: rebuild the shard (replay the log "
                "into an empty replica) or keep the language"
            )
        directory = _fresh(root)
        for name, data in files.items():
            if os.path.basename(name) != name or name.startswith("."):
                raise ValueError(f"text index file {name!r} is not a plain file name")
            (directory / name).write_bytes(data)
        return cls(directory, language, tantivy.Index.open(str(directory)))

    # --- writes ----------------------------------------------------------------------

    def apply(self, removes: Iterable[int], adds: Sequence[TextDoc]) -> None:
        """:meth:`stage` then :meth:`refresh`: the changes searchable on return."""
        self.stage(removes, adds)
        self.refresh()

    def stage(self, removes: Iterable[int], adds: Sequence[TextDoc]) -> None:
        """Delete ``removes`` (FAISS ids; an upserted id is among them) and add ``adds``
        in the writer, not yet searchable (a fraction of a millisecond: no commit)."""
        writer = self._live_writer()
        for fid in removes:
            writer.delete_documents_by_term("fid", int(fid))
        for doc in adds:
            tags = [tag_term(k, v) for k, v in doc.tags.items()]
            writer.add_document(tantivy.Document(fid=doc.fid, body=doc.body, tag=tags))
        self.pending = True

    def refresh(self) -> None:
        """Commit what was staged and search it from now on: a new segment, its files
        synced, a new searcher (about 10 ms of CPU whatever the number of changes, so
        the shard batches them: docs/index.md "The text index's refresh"). Searches
        running meanwhile go on with the searcher they took."""
        if not self.pending:
            return
        self._live_writer().commit()
        self._index.reload()
        self._searcher = self._index.searcher()
        self.pending = False

    # --- reads -----------------------------------------------------------------------

    def terms(self, query: str) -> list[str]:
        """The distinct indexable terms of ``query``, in order; InvalidArgument past
        :data:`MAX_QUERY_TERMS` distinct words (counted before stemming, as the gateway
        counts them: :func:`services.common.terms.check_query_terms`; a query of no
        indexable term has none: not an error)."""
        check_query_terms(query, LIMITS, "")
        return list(dict.fromkeys(self._analyzer.analyze(query)))

    def search(
        self,
        queries: Sequence[Sequence[str]],
        k: int,
        filter: Sequence[tuple[str, Sequence[str]]] = (),
    ) -> TextHits:
        """BM25 top-``k`` of each query, given as its :meth:`terms`; with ``filter``, only
        documents whose metadata meet every (key, any of values) condition."""
        conditions = [
            (
                tantivy.Occur.Must,
                tantivy.Query.const_score_query(  # selects; adds nothing to the BM25 score
                    tantivy.Query.term_set_query(
                        self._schema, "tag", [tag_term(key, v) for v in values]
                    ),
                    0.0,
                ),
            )
            for key, values in filter
        ]
        fids = np.full((len(queries), k), -1, dtype=np.int64)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        searcher = self._searcher
        for row, terms in enumerate(queries):
            if not terms:
                continue
            query = tantivy.Query.boolean_query(
                [
                    (
                        tantivy.Occur.Should,
                        tantivy.Query.term_query(self._schema, "body", t, index_option="freq"),
                    )
                    for t in terms
                ]
            )
            if conditions:  # the terms score, the conditions only select
                query = tantivy.Query.boolean_query([(tantivy.Occur.Must, query), *conditions])
            hits = searcher.search(query, k, count=False).hits
            if not hits:
                continue
            found = searcher.fast_field_values("fid", [address for _, address in hits])
            n = len(hits)
            fids[row, :n] = np.asarray(found, dtype=np.int64)
            scores[row, :n] = np.asarray([score for score, _ in hits], dtype=np.float32)
        return TextHits(fids, scores)

    def __len__(self) -> int:
        return int(self._searcher.num_docs)

    def stats(self) -> TextStats:
        """Documents and segments (from the open searcher, in memory) and the working
        directory's bytes, ``None`` when the directory or one of its files cannot be read
        (removed, replaced by a file, unmounted; an entry the OS cannot stat): a scrape
        reports what it can instead of failing, and a sum that would leave a file out is
        no figure of the directory."""
        disk: int | None = 0
        try:
            entries = list(self.directory.iterdir())
        except OSError as e:
            log.warning("text index directory %s unreadable: %s", self.directory, e)
            disk, entries = None, []
        for path in entries:
            try:
                size = path.stat().st_size if path.is_file() else 0
            except FileNotFoundError:  # a merge's garbage collection removed it meanwhile
                continue
            except OSError as e:
                log.warning("text index file %s unreadable: %s", path, e)
                disk = None
                break
            disk = (disk or 0) + size
        return TextStats(len(self), int(self._searcher.num_segments), disk)

    # --- snapshots -------------------------------------------------------------------

    def export_files(self) -> dict[str, bytes]:
        """The committed index as files (``meta.json``, its segments' files, our own
        ``gtr-text.json``): what :meth:`restore` takes.

        The caller holds the shard's write lock (no commit meanwhile). Merges run in
        Tantivy's background threads and rewrite ``meta.json`` when they end, so they are
        waited for first (which consumes the writer: a new one is opened after).
        """
        with self._export_lock:
            self.refresh()  # waiting for the merges drops the writer, and what it staged
            self._live_writer().wait_merging_threads()
            self._writer = self._index.writer(WRITER_HEAP_BYTES, 1)
            self._writer.garbage_collect_files()
            meta_bytes = (self.directory / META).read_bytes()
            segments = {
                s["segment_id"].replace("-", "") for s in json.loads(meta_bytes)["segments"]
            }
            files = {META: meta_bytes}
            for path in sorted(self.directory.iterdir()):
                if path.is_file() and path.name.split(".")[0] in segments:
                    files[path.name] = path.read_bytes()
            files[OWN_META] = json.dumps({"language": self.language}).encode()
            return files

    def _live_writer(self) -> tantivy.IndexWriter:
        if self._writer is None:
            raise RuntimeError(f"text index {self.directory} is closed")
        return self._writer

    def close(self) -> None:
        """Drop the writer (its lock) and remove the working directory."""
        self._writer = None
        _IN_USE.discard(self.directory)
        shutil.rmtree(self.directory, ignore_errors=True)


def _fresh(root: Path) -> Path:
    """A new working directory under ``root``; the others not in use by this process
    (left by a previous run of the replica: a pod's process may well get the same pid)
    are removed."""
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob("live-*"):
        if old not in _IN_USE:
            shutil.rmtree(old, ignore_errors=True)
    directory = root / f"live-{os.getpid()}-{time.monotonic_ns()}"
    directory.mkdir()
    _IN_USE.add(directory)
    return directory


# The working directories of this process's open text indexes (one root per replica).
_IN_USE: set[Path] = set()
