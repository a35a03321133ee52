"""The int8 query tower, and int8 documents, against FP32 (issues #34, #33;
docs/performance.md "The int8 query tower").

One run, one process: the default model (all-MiniLM-L6-v2) exported to ONNX, its query
tower quantized and gated as ``encoder export --query-precision int8`` does
(:func:`~services.encoder.build.query_int8.add_int8_query_tower`, the gates' record kept as
``gates``), then on SciFact's dev queries (the eval's split):

* encode CPU ms per query, one query per run as served, ONNX Runtime on 1 thread,
  FP32 and int8 alternating query by query over ``--rounds`` passes (so that other work
  on the machine weighs on both alike); ``speedup`` = FP32 ms ÷ int8 ms;
* cosine of each int8 query vector with its FP32 vector (min, mean);
* dev nDCG@10 of both (exact search over the shared FP32 document vectors) with the
  paired bootstrap interval, row by row (``batch_1``, as served) and in batches of
  ``--batch`` (``batched``: what serving int8 queries batched would cost; dynamic
  quantisation scales each activation tensor over the whole batch).

Documents (the same quantized graph serving them, ``--document-precision int8``): CPU ms
per document over SciFact's first ``--documents`` documents, the FP32 graph batched (as
Triton batches FP32 documents) and row by row, the int8 graph row by row (as served),
alternating; and the document gates (parity, and dev nDCG@10 of int8 queries over int8
documents against FP32 over FP32), kept as ``documents``.

The machine's load average is recorded before and after (``loaded``).

``--record`` also writes the gates' result for these graphs (their SHA-256, the parity
cosines, the quality gate's figures) to ``services/encoder/build/query_int8_record.json``,
the record an export without the data takes its quality result from
(:mod:`services.encoder.build.int8_record`).

Usage: ``python -m bench.query_int8 [--rounds 3] [--batch 32] [--record]
[--out bench/results/query_int8.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SHARED = Path(os.environ.get("GTR_DATA_DIR", Path(__file__).resolve().parents[2] / "shared/data"))
SCIFACT = SHARED / "scifact"


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def encode_ms(fp32: Any, int8: Any, codec: Any, texts: list[str], rounds: int) -> dict[str, Any]:
    """CPU ms per query of each session, one query per run, alternating query by query."""
    spent = {"fp32": 0.0, "int8": 0.0}
    sessions = {"fp32": fp32, "int8": int8}
    batches = [codec.encode([t], "query") for t in texts]
    for session in sessions.values():  # warm-up
        for b in batches[:10]:
            feeds = {"input_ids": b.input_ids, "attention_mask": b.attention_mask}
            session.run(["embedding"], feeds)
    for _ in range(rounds):
        for b in batches:
            feeds = {"input_ids": b.input_ids, "attention_mask": b.attention_mask}
            for name, session in sessions.items():
                start = time.thread_time()
                session.run(["embedding"], feeds)
                spent[name] += time.thread_time() - start
    runs = rounds * len(texts)
    ms = {name: round(1e3 * s / runs, 3) for name, s in spent.items()}
    return {**ms, "speedup": round(ms["fp32"] / ms["int8"], 2), "queries_timed": runs}


def document_encode_ms(
    fp32: Any, int8: Any, codec: Any, texts: list[str], batch: int
) -> dict[str, Any]:
    """CPU ms per document: the FP32 graph in batches of ``batch`` (padded to the longest,
    as Triton batches FP32 documents) and one row per run, the int8 graph one row per run
    (as served); alternating slice by slice, so other work weighs on all three alike."""
    spent = {"fp32_batched": 0.0, "fp32_rows": 0.0, "int8_rows": 0.0}

    def run(session: Any, rows: list[str]) -> float:
        b = codec.encode(rows, "document")
        start = time.thread_time()
        session.run(["embedding"], {"input_ids": b.input_ids, "attention_mask": b.attention_mask})
        return time.thread_time() - start

    run(fp32, texts[:4])
    run(int8, texts[:1])  # warm-up
    for i in range(0, len(texts), batch):
        piece = texts[i : i + batch]
        spent["fp32_batched"] += run(fp32, piece)
        spent["fp32_rows"] += sum(run(fp32, [t]) for t in piece)
        spent["int8_rows"] += sum(run(int8, [t]) for t in piece)
    ms = {name: round(1e3 * s / len(texts), 2) for name, s in spent.items()}
    return {
        **ms,
        "speedup": round(ms["fp32_batched"] / ms["int8_rows"], 2),
        "speedup_over_fp32_rows": round(ms["fp32_rows"] / ms["int8_rows"], 2),
        "documents_timed": len(texts),
        "batch": batch,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3, help="timed passes over the queries")
    parser.add_argument("--batch", type=int, default=32, help="the batched nDCG's batch size")
    parser.add_argument("--documents", type=int, default=320, help="documents timed")
    parser.add_argument("--out", type=Path, default=Path("bench/results/query_int8.json"))
    parser.add_argument(
        "--record",
        action="store_true",
        help="write the gates' result for these graphs to the committed record",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from services.corpus.beir import load_beir
    from services.encoder.build.export import INT8_ONNX, export_onnx, onnx_session
    from services.encoder.build.int8_quality import dev_split, embed_texts, export_codec
    from services.encoder.build.query_int8 import (
        add_int8_query_tower,
        dev_ndcg,
        quality_dict,
    )
    from services.encoder.model import default_model_dir

    load_before = _loadavg()
    result: dict[str, Any] = {"model": "all-MiniLM-L6-v2", "data": str(SCIFACT)}
    with tempfile.TemporaryDirectory(prefix="gtr-bench-int8-") as tmp:
        fp32_path = Path(tmp) / "export" / "model.onnx"
        export_onnx(default_model_dir(), fp32_path)
        add_int8_query_tower(fp32_path, SCIFACT, documents=True)
        int8_path = fp32_path.parent / INT8_ONNX
        result["gates"] = json.loads((fp32_path.parent / "query_int8.json").read_text())
        result["bytes"] = {"fp32": fp32_path.stat().st_size, "int8": int8_path.stat().st_size}
        if args.record:
            from services.encoder.build.int8_record import write_record

            recorded = write_record(
                result["model"],
                fp32_path,
                int8_path,
                result["gates"],
                "python -m bench.query_int8 --record",
            )
            result["record"] = {
                "fp32_sha256": recorded.fp32_sha256,
                "int8_sha256": recorded.int8_sha256,
            }
        data = load_beir(SCIFACT)
        texts = [data.queries[q] for q in dev_split(data)]
        codec = export_codec(fp32_path.parent)
        fp32, int8 = onnx_session(fp32_path, 1), onnx_session(int8_path, 1)
        result["encode_cpu_ms_per_query"] = encode_ms(fp32, int8, codec, texts, args.rounds)
        a = embed_texts(fp32, codec, texts, "query", batch=1)
        b = embed_texts(int8, codec, texts, "query", batch=1)
        cos = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        result["cosine_int8_vs_fp32"] = {
            "min": round(float(cos.min()), 4),
            "mean": round(float(cos.mean()), 4),
        }
        docs = [data.docs[d] for d in data.doc_ids[: args.documents]]
        result["documents"] = {
            "encode_cpu_ms_per_document": document_encode_ms(fp32, int8, codec, docs, args.batch),
            "gates": result["gates"]["documents"],
        }
        result["ndcg_at_10"] = {
            "batch_1": quality_dict(dev_ndcg(fp32_path, int8_path, SCIFACT, batch=1)),
            "batched": quality_dict(dev_ndcg(fp32_path, int8_path, SCIFACT, batch=args.batch)),
        }
    result["loadavg_before"], result["loadavg_after"] = load_before, _loadavg()
    busy = max(result["loadavg_before"][0], result["loadavg_after"][0])
    result["loaded"] = busy > 0.5 * len(os.sched_getaffinity(0))
    e = result["encode_cpu_ms_per_query"]
    print(
        f"encode {e['fp32']:.2f} -> {e['int8']:.2f} ms/query ({e['speedup']}x); cosine "
        f"{result['cosine_int8_vs_fp32']}; nDCG@10 "
        + "; ".join(
            f"{k}: {v['fp32_ndcg_at_10']} -> {v['int8_ndcg_at_10']} {v['paired']['ci95']}"
            for k, v in result["ndcg_at_10"].items()
        )
    )
    d = result["documents"]["encode_cpu_ms_per_document"]
    q = result["documents"]["gates"]["quality"]
    print(
        f"documents: FP32 batched {d['fp32_batched']} ms, FP32 rows {d['fp32_rows']} ms, "
        f"int8 rows {d['int8_rows']} ms ({d['speedup']}x); int8 queries over int8 documents "
        f"nDCG@10 {q['fp32_ndcg_at_10']} -> {q['int8_ndcg_at_10']} {q['paired']['ci95']}"
    )
    if result["loaded"]:
        print(f"the machine was loaded (load average {busy}): figures are not a quiet run's")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    body = {"source": {"bench": "query_int8", "run": now}, **result}
    args.out.write_text(json.dumps(body, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
