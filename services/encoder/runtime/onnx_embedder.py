"""The ONNX export run with ONNX Runtime in this process: the CPU serving path's core.

It reads an export folder (``model.onnx``, ``tokenizer.json``, ``encoder.json``) and
nothing else, exactly as the Triton CPU model does, so the in-process embedded mode
and Triton serve the same numbers. A two-tower export (``encoder.json`` ``towers``) embeds
each kind with its own graph, as the Triton model does; an int8 tower
(``query_precision``, ``document_precision``) runs one row per graph run, unpadded.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from services.encoder.build.export import OUTPUT_NAME, EncoderMeta, onnx_session
from services.encoder.profiles import Kind
from services.encoder.textcodec import TextCodec, TokenBatch, run_in_pieces

# Codecs kept by what they are built from (the tokenizer file's bytes, each kind's token
# budget, the pad id): at most this many, the least recently used dropped first.
CODECS_KEPT = 4
_codecs: OrderedDict[tuple[str, tuple[tuple[str, int], ...], int], TextCodec] = OrderedDict()
_codecs_lock = threading.Lock()


def shared_codec(tokenizer_json: Path, max_lens: Mapping[str, int], pad_id: int) -> TextCodec:
    """The codec of ``tokenizer_json`` with these budgets, shared by every embedder of this
    process that reads the same bytes (a codec is immutable once built, and thread-safe).

    Building one holds the GIL throughout: ``tokenizers`` parses the file, then copies it
    once per kind, in Rust without releasing it (26 ms on a quiet core, ~75 ms on a busy
    one). A gateway that opens a rollout target's query graph while it serves searches
    stalled its event loop that long (a 2-s window of search p99 115 ms in a bench
    rollout, the rest ~40; docs/generations.md "The phase changes, profiled"). A new
    encoder version of the same base model keeps its tokenizer, so it is parsed once per
    process instead. Hashing the file releases the GIL."""
    data = tokenizer_json.read_bytes()
    key = (hashlib.sha256(data).hexdigest(), tuple(sorted(max_lens.items())), pad_id)
    with _codecs_lock:
        codec = _codecs.get(key)
        if codec is not None:
            _codecs.move_to_end(key)
            return codec
    codec = TextCodec.from_file(str(tokenizer_json), dict(max_lens), pad_id)
    with _codecs_lock:
        codec = _codecs.setdefault(key, codec)  # a build that raced ours: keep the first
        _codecs.move_to_end(key)
        while len(_codecs) > CODECS_KEPT:
            _codecs.popitem(last=False)
    return codec


class OnnxEmbedder:
    """Texts in, (vectors, truncated) out, with ONNX Runtime. Synchronous, thread-safe."""

    backend = "onnx"

    def __init__(
        self, onnx_path: Path, threads: int | None = None, graphs: Mapping[Kind, Path] | None = None
    ) -> None:
        """``graphs``: the graph of each kind served, when they are not the export's own
        files (a Triton version folder names its towers otherwise: ``repository.TOWER_ONNX``);
        ``onnx_path`` then only locates ``encoder.json`` and ``tokenizer.json``."""
        onnx_path = Path(onnx_path)
        self.meta = EncoderMeta.read(onnx_path.parent)
        self.model_name = self.meta.model_name
        self.dim = self.meta.dim
        self.profile = self.meta.profile_obj
        self.codec = shared_codec(
            onnx_path.parent / "tokenizer.json", self.meta.max_lens, self.meta.pad_id
        )
        files = dict(graphs) if graphs is not None else self.meta.onnx_files(onnx_path)
        opened: dict[Path, object] = {}
        for path in files.values():
            if path not in opened:
                opened[path] = onnx_session(path, threads)
        self.sessions = {kind: opened[path] for kind, path in files.items()}
        self.threads = threads  # they size the pieces a batch runs in (TokenBatch.pieces)

    def tokenize(self, texts: list[str], kind: Kind) -> TokenBatch:
        return self.codec.encode(texts, kind)

    def run(self, batch: TokenBatch, kind: Kind = "query") -> np.ndarray:
        """The graph of ``kind`` (one graph serves both kinds unless the export has two),
        in pieces of rows of about one length (``textcodec.length_pieces``), as the Triton
        model runs them."""
        session = self.sessions[kind]
        # an int8 graph runs one row per run: its activation scales span the whole batch,
        # so a row's vector would depend on its companions (query_int8.py)
        pieces = batch.pieces(self.threads, one_row=kind in self.meta.row_by_row())

        def graph(part: TokenBatch) -> np.ndarray:
            feeds = {"input_ids": part.input_ids, "attention_mask": part.attention_mask}
            return session.run([OUTPUT_NAME], feeds)[0]  # type: ignore[attr-defined,no-any-return]

        return run_in_pieces(batch, pieces, graph)

    def embed(self, texts: list[str], kind: Kind) -> tuple[np.ndarray, list[bool]]:
        batch = self.tokenize(texts, kind)
        return self.run(batch, kind), batch.truncated.tolist()
