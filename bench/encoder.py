"""Encoder benchmark: ONNX Runtime vs PyTorch, Triton vs in-process, Triton latency.

Prints human-readable lines, then one JSON line last:

* ``onnx_vs_torch``: speed of ONNX Runtime ÷ PyTorch eager, batch 1, one 32-token
  query, both on ``--threads`` threads (goal ≥ 1.3);
* ``triton_vs_inprocess``: texts/s of single-text requests to Triton at concurrency
  16 ÷ texts/s of the in-process ONNX encoder on batches of 16 (goal ≥ 0.8); the two are
  measured in ``--rounds`` alternating slices with Triton up, and medians compared;
* ``p50_ms``/``p99_ms``: one query through Triton at concurrency 1, next to the
  profile's ``slo_ms``;
* ``int8_speedup``/``int8_min_cosine``: dynamic int8 quantisation vs fp32 ONNX.

Usage: ``python -m bench.encoder [--model-dir DIR] [--seconds 5] [--threads 2]``.
Triton runs on this machine (CPU repository from the nvidia-pytriton wheel), so server
and client share the cores: the figures are a CPU-only lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

QUERY_TOKENS = 32
SCIFACT = (
    Path(os.environ.get("GTR_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))
    / "scifact"
)


@functools.cache
def _words() -> list[str]:
    path = SCIFACT / "queries.jsonl"
    if path.exists():
        with path.open() as f:
            return " ".join(json.loads(line)["text"] for line in f).split()
    return ("dense retrieval with large dual encoders generalizes across domains " * 50).split()


def make_text(codec: Any, tokens: int, offset: int = 0) -> str:
    """Real words (SciFact queries) that tokenize to ``tokens`` ids, special tokens included."""
    words = _words()
    for n in range(1, tokens + 1):
        text = " ".join(words[offset : offset + n])
        if int(codec.encode([text], "document").attention_mask.sum()) >= tokens:
            return text
    return " ".join(words[offset : offset + tokens])


def timed(fn: Callable[[], object], seconds: float, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def bench_onnx_vs_torch(
    model_dir: Path, onnx_path: Path, args: argparse.Namespace
) -> dict[str, float]:
    import torch

    from services.encoder.model import TorchEmbedder
    from services.encoder.runtime.onnx_embedder import OnnxEmbedder

    torch.set_num_threads(args.threads)
    torch_e = TorchEmbedder(model_dir)
    onnx_e = OnnxEmbedder(onnx_path, threads=args.threads)
    query = make_text(onnx_e.codec, QUERY_TOKENS)
    batch = onnx_e.tokenize([query], "query")
    t_torch = statistics.median(timed(lambda: torch_e.run(batch), args.seconds))
    t_onnx = statistics.median(timed(lambda: onnx_e.run(batch), args.seconds))
    print(
        f"batch 1 × {batch.input_ids.shape[1]} tokens, {args.threads} threads: "
        f"torch {t_torch * 1e3:.2f} ms, onnx {t_onnx * 1e3:.2f} ms"
    )
    out = {
        "query_tokens": int(batch.input_ids.shape[1]),
        "torch_ms": t_torch * 1e3,
        "onnx_ms": t_onnx * 1e3,
        "onnx_vs_torch": t_torch / t_onnx,
    }
    if not args.skip_int8:
        from services.encoder.build.export import quantize_int8, row_cosines

        q_path = quantize_int8(onnx_path, onnx_path.with_name("model.int8.onnx"))
        q_e = OnnxEmbedder(q_path, threads=args.threads)
        t_int8 = statistics.median(timed(lambda: q_e.run(batch), args.seconds))
        docs = [make_text(onnx_e.codec, 120, offset=i * 50) for i in range(16)]
        d_batch = onnx_e.tokenize(docs, "document")
        cos = min(row_cosines(q_e.run(d_batch), onnx_e.run(d_batch)))
        print(f"int8 dynamic (per-channel): {t_int8 * 1e3:.2f} ms, min cosine vs fp32 {cos:.4f}")
        out |= {"int8_speedup": t_onnx / t_int8, "int8_min_cosine": cos}
    return out


async def _latency(enc: Any, texts: list[str], seconds: float) -> list[float]:
    """Seconds per request, one query at a time (concurrency 1)."""
    latencies: list[float] = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        start = time.perf_counter()
        await enc.encode([texts[i % len(texts)]], "query")
        latencies.append(time.perf_counter() - start)
        i += 1
    return latencies


async def _rate(enc: Any, texts: list[str], seconds: float, concurrency: int = 16) -> float:
    """Texts/s of single-text requests from ``concurrency`` closed-loop clients."""
    done = 0
    end = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        nonlocal done
        j = k
        while time.perf_counter() < end:
            await enc.encode([texts[j % len(texts)]], "query", timeout=30)
            done += 1
            j += concurrency

    start = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return done / (time.perf_counter() - start)


async def _triton_figures(
    grpc_url: str, texts: list[str], inproc_rate: Callable[[float], float], args: argparse.Namespace
) -> dict[str, float]:
    """Latency at concurrency 1, then ``--rounds`` alternations of in-process and Triton
    throughput: drift of a shared machine hits both sides, and the medians are compared."""
    from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig

    enc = await TritonEncoder.connect(TritonEncoderConfig(grpc_url))
    try:
        for text in texts[:20]:  # warm-up
            await enc.encode([text], "query")
        ms = np.array(await _latency(enc, texts, args.seconds)) * 1e3
        slice_s = args.seconds / args.rounds
        inproc, triton = [], []
        for _ in range(args.rounds):
            inproc.append(inproc_rate(slice_s))
            triton.append(await _rate(enc, texts, slice_s))
    finally:
        await enc.close()
    ratios = [t / i for t, i in zip(triton, inproc, strict=True)]
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "triton_texts_per_s": statistics.median(triton),
        "inprocess_texts_per_s": statistics.median(inproc),
        "rounds_ratio_min": min(ratios),
        "rounds_ratio_max": max(ratios),
    }


def bench_triton(onnx_path: Path, args: argparse.Namespace) -> dict[str, float]:
    from services.encoder.build.repository import RepositoryConfig, generate_repository
    from services.encoder.runtime.onnx_embedder import OnnxEmbedder
    from services.encoder.serve.triton_server import TritonServerConfig, run_triton
    from tests.support.processes import free_port

    inproc = OnnxEmbedder(onnx_path, threads=args.threads)
    texts = [make_text(inproc.codec, QUERY_TOKENS, offset=i * 40) for i in range(64)]
    batches = [texts[i : i + 16] for i in range(0, 64, 16)]
    k = 0

    def one_batch() -> None:
        nonlocal k
        inproc.embed(batches[k % len(batches)], "query")
        k += 1

    def inproc_rate(seconds: float) -> float:
        return 16 / statistics.median(timed(one_batch, seconds))

    with tempfile.TemporaryDirectory(prefix="gtr-bench-") as tmp:
        repo = Path(tmp) / "repo"
        # Default: the CPU layout of `encoder repo` (1 instance, threads = cores).
        generate_repository(
            onnx_path,
            repo,
            RepositoryConfig(instances=args.instances, max_queue_delay_us=args.queue_delay_us),
        )
        cfg = TritonServerConfig(
            repo, grpc_port=free_port(), http_port=free_port(), metrics_port=free_port()
        )
        with run_triton(cfg, Path(tmp) / "triton.log") as handle:
            figures = asyncio.run(_triton_figures(handle.grpc_url, texts, inproc_rate, args))
    ratio = figures["triton_texts_per_s"] / figures["inprocess_texts_per_s"]
    print(
        f"in-process ONNX, batches of 16: {figures['inprocess_texts_per_s']:.0f} texts/s "
        f"(median of {args.rounds} rounds)"
    )
    print(
        f"Triton: p50 {figures['p50_ms']:.2f} ms, p99 {figures['p99_ms']:.2f} ms at "
        f"concurrency 1; {figures['triton_texts_per_s']:.0f} texts/s at concurrency 16 "
        f"(ratio {ratio:.2f}, rounds {figures['rounds_ratio_min']:.2f}–"
        f"{figures['rounds_ratio_max']:.2f})"
    )
    return figures | {"triton_vs_inprocess": ratio}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model-dir", help="sentence-transformers checkpoint (default MiniLM)")
    parser.add_argument("--seconds", type=float, default=5.0, help="time per measurement")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    parser.add_argument("--skip-int8", action="store_true", help="skip the int8 measurement")
    parser.add_argument("--skip-triton", action="store_true", help="skip the Triton part")
    parser.add_argument("--instances", type=int, help="Triton CPU instances (default: repo's)")
    parser.add_argument(
        "--rounds", type=int, default=4, help="alternations of in-process and Triton throughput (4)"
    )
    parser.add_argument("--queue-delay-us", type=int, help="dynamic batching delay (repo's)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from services.encoder.build.export import EncoderMeta, export_onnx
    from services.encoder.model import default_model_dir

    model_dir = Path(args.model_dir) if args.model_dir else default_model_dir()
    with tempfile.TemporaryDirectory(prefix="gtr-bench-export-") as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        meta: EncoderMeta = export_onnx(model_dir, onnx_path)
        result: dict[str, Any] = {"model": meta.model_name, "threads": args.threads}
        result |= bench_onnx_vs_torch(model_dir, onnx_path, args)
        if not args.skip_triton:
            result |= bench_triton(onnx_path, args)
        result["slo_ms"] = meta.profile_obj.slo_ms
        result["slo_source"] = meta.profile_obj.slo_source
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return result


if __name__ == "__main__":
    main()
