"""Document encodes in pieces of rows by length against rows in arrival order, one run.

    .venv/bin/python -m bench.document_pieces [--docs 640] [--batch 32] [--rounds 3]
        [--threads 1,2] [--corpora stdlib,scifact]

The FP32 document graph of the default model (``up``'s documents; ``encoder export``,
ONNX Runtime, this process), the same documents of each corpus (title and text, a seeded
sample of ``--docs``) sent as requests of ``--batch`` rows, as a Triton model instance or
``OnnxEmbedder.run`` gets them:

- ``arrival``: each request run in pieces of 16 rows in arrival order, each piece padded
  to its longest row (the Triton model before this bench; the in-process encoder ran a
  request whole, padded to its longest row);
- ``by_length``: each request through ``OnnxEmbedder.run`` as served now, in the pieces
  :meth:`~services.encoder.textcodec.TokenBatch.pieces` makes (rows of about one length,
  at most 16, padding at most a tenth of the real tokens, on one thread at most 512
  tokens a piece), as the Triton model runs them too.

Per corpus and ONNX thread count: documents/s of each (median of ``--rounds``, the two
alternated, order swapped every round) and ``by_length_over_arrival``. Tokenizing is
counted in both. One JSON line last (``--out``, default
``bench/results/document_pieces.json``). Run it alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.floor import SCIFACT
from services.corpus.readers import read_corpus
from services.corpus.stdlib import collect_in_subprocess
from services.encoder.build.export import export_onnx
from services.encoder.model import default_model_dir
from services.encoder.runtime.onnx_embedder import OnnxEmbedder
from services.encoder.textcodec import PIECE_ROWS, TokenBatch
from services.generations.encoding import embedding_text

RESULT = Path(__file__).resolve().parent / "results" / "document_pieces.json"
POLICIES = ("arrival", "by_length")


def corpus_texts(name: str, n: int, seed: int = 0) -> list[str]:
    """A seeded sample of ``n`` documents of the corpus, as the stack embeds them."""
    if name == "stdlib":
        docs = [(d.title, d.text) for d in collect_in_subprocess()]
    elif name == "scifact":
        docs = [(d.title, d.text) for d in read_corpus(SCIFACT / "corpus.jsonl")]
    else:
        raise SystemExit(f"unknown corpus {name!r}: stdlib or scifact")
    picked = random.Random(seed).sample(docs, min(n, len(docs)))
    return [embedding_text(title, text) for title, text in picked]


def pieces_of(policy: str, tokens: TokenBatch, threads: int) -> list[list[int]]:
    """The rows of a request in the policy's pieces."""
    if policy == "arrival":
        n = len(tokens.truncated)
        return [list(range(i, min(i + PIECE_ROWS, n))) for i in range(0, n, PIECE_ROWS)]
    return tokens.pieces(threads)


def docs_per_s(embedder: OnnxEmbedder, texts: list[str], batch: int, policy: str) -> float:
    """Every request of ``batch`` texts tokenized and run: ``by_length`` through
    ``OnnxEmbedder.run`` as served, ``arrival`` in pieces of 16 in request order."""
    session = embedder.sessions["document"]
    start = time.perf_counter()
    for at in range(0, len(texts), batch):
        tokens = embedder.tokenize(texts[at : at + batch], "document")
        if policy == "by_length":
            embedder.run(tokens, "document")
            continue
        for piece in pieces_of(policy, tokens, 0):
            part = tokens.take(piece)
            session.run(  # type: ignore[attr-defined]
                ["embedding"], {"input_ids": part.input_ids, "attention_mask": part.attention_mask}
            )
    return len(texts) / (time.perf_counter() - start)


def padding(texts: list[str], embedder: OnnxEmbedder, batch: int, policy: str) -> float:
    """Padded tokens ÷ real tokens under the policy."""
    real = padded = 0
    for at in range(0, len(texts), batch):
        tokens = embedder.tokenize(texts[at : at + batch], "document")
        lengths = tokens.lengths.tolist()
        real += sum(lengths)
        assert embedder.threads is not None
        for piece in pieces_of(policy, tokens, embedder.threads):
            padded += max(lengths[i] for i in piece) * len(piece)
    return padded / real


def measure(onnx: Path, texts: list[str], threads: int, batch: int, rounds: int) -> dict[str, Any]:
    embedder = OnnxEmbedder(onnx, threads=threads)
    embedder.embed(texts[:batch], "document")  # warm up
    rates: dict[str, list[float]] = {p: [] for p in POLICIES}
    for r in range(rounds):
        for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
            rates[policy].append(docs_per_s(embedder, texts, batch, policy))
    out: dict[str, Any] = {
        f"{p}_docs_per_s": round(statistics.median(v), 2) for p, v in rates.items()
    }
    out |= {f"{p}_rounds": [round(x, 2) for x in v] for p, v in rates.items()}
    out |= {f"{p}_padding": round(padding(texts, embedder, batch, p), 3) for p in POLICIES}
    out["by_length_over_arrival"] = round(
        out["by_length_docs_per_s"] / out["arrival_docs_per_s"], 3
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=640)
    parser.add_argument("--batch", type=int, default=32, help="rows per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="1,2", help="ONNX Runtime threads to measure")
    parser.add_argument("--corpora", default="stdlib,scifact")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gtr-bench-pieces-") as tmp:
        onnx = Path(tmp) / "model.onnx"
        export_onnx(default_model_dir(), onnx)
        for corpus in args.corpora.split(","):
            texts = corpus_texts(corpus, args.docs)
            lengths = np.asarray(OnnxEmbedder(onnx, threads=1).tokenize(texts, "document").lengths)
            results[corpus] = {
                "tokens_mean": round(float(lengths.mean()), 1),
                "tokens_p10_p90": [int(np.percentile(lengths, q)) for q in (10, 90)],
            }
            for t in threads:
                got = measure(onnx, texts, t, args.batch, args.rounds)
                results[corpus][f"threads_{t}"] = got
                print(
                    f"{corpus}, {t} ONNX thread(s): by length {got['by_length_docs_per_s']} "
                    f"docs/s, arrival order {got['arrival_docs_per_s']} docs/s: "
                    f"{got['by_length_over_arrival']}x (padding {got['arrival_padding']} -> "
                    f"{got['by_length_padding']} of the real tokens)",
                    flush=True,
                )
    record = {
        "source": {
            "bench": "document_pieces",
            "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "docs": args.docs,
        "batch": args.batch,
        "rounds": args.rounds,
        "corpora": results,
    }
    line = json.dumps(record)
    print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
