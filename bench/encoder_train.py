"""Encoder training bench (issue #23): the five dual-encoder variants against the base.

Stages (each skippable), all written to one JSON object (``--out``, default
``bench/results/encoder_train.json``) by this command:

* ``--train``: run ``gtr-retrieval encoder train`` for every variant whose checkpoint in
  ``--runs`` is missing or incomplete, one after the other, with the ``--recipe`` (the same
  for all); the trainer records its wall time, CPU time and peak RSS in the manifest.
* evaluation: ``eval --encoder``'s comparison (:func:`services.encoder.train.evaluate.compare`)
  of the base checkpoint and every complete variant on the trainers' dev split: nDCG@10,
  paired bootstrap 95 % interval of the difference, Recall@100, MRR@10, contrastive
  entropy, query/document separability and a t-SNE PNG per system (``--plots``).
* ``--triton``: each checkpoint exported and served by its own CPU Triton repository
  (model ``embed``): the p50 of one query at concurrency 1, base vs trained SDE, measured
  in alternating rounds so that the drift of a shared machine hits both (goal: within
  5 %); and ADE-SPL's two towers through Triton against the in-process PyTorch towers
  (min cosine per tower, goal ≥ 0.999).

Usage: ``python -m bench.encoder_train --runs /tmp/enc23/runs --train --triton``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

ARCHS = ("sde", "ade-spl", "ade", "ade-ste", "ade-fte")
SCIFACT = (
    Path(os.environ.get("GTR_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))
    / "scifact"
)
# The default recipe (`encoder train` defaults) cut for a shared 2-core machine: half an
# epoch, documents at 96 tokens for training and evaluation, evaluation on 1,200 documents
# (the dev queries' judged ones plus a seeded sample). The same for every variant.
CUT_RECIPE = [
    "--epochs",
    "0.5",
    "--max-doc-len",
    "96",
    "--eval-doc-len",
    "96",
    "--eval-corpus",
    "1200",
    "--eval-every",
    "0",
]
# The trainer's defaults (one epoch, documents at 192 tokens, dev evaluated over the whole
# corpus at the serving 256 tokens); only the in-training dev curve is off (it costs an
# encode of the dev pool every --eval-every steps and changes no weight).
FULL_RECIPE = ["--eval-every", "0"]
RECIPES = {"full": FULL_RECIPE, "cut": CUT_RECIPE}
FULL_NOTE = (
    "the trainer's default recipe for every variant: one epoch, documents at 192 tokens "
    "for training, dev evaluated by exact search over all corpus documents at 256 tokens"
)
CUT_NOTE = (
    "cut for time on 2 CPU cores shared with 7 other engineers (load average ~12: the "
    "trainer got ~20-35 % of a core): 0.5 epoch instead of 1, documents truncated to 96 "
    "tokens (train and eval) instead of 192/256, dev evaluated by exact search over a "
    "1,200-document sample of the corpus (all judged documents of the dev queries + a "
    "seeded random sample) instead of all 5,183; identical for the base and every variant"
)


def complete(checkpoint: Path) -> bool:
    path = checkpoint / "manifest.json"
    if not path.exists():
        return False
    manifest = json.loads(path.read_text())
    return bool(manifest.get("complete")) and "ndcg_at_10" in manifest.get("dev", {})


def train_missing(
    runs: Path, data: Path, threads: int, archs: tuple[str, ...], recipe: list[str]
) -> None:
    for arch in archs:
        out = runs / arch
        if complete(out):
            continue
        cmd = [
            sys.executable,
            "-m",
            "services.cli.main",
            "encoder",
            "train",
            "--data",
            str(data),
            "--arch",
            arch,
            "--out",
            str(out),
            "--threads",
            str(threads),
            "--quiet",
            *recipe,
        ]
        print(f"training {arch}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True)


async def _p50_rounds(
    urls: dict[str, str], texts: list[str], rounds: int, seconds: float
) -> dict[str, list[float]]:
    """Per system, the latencies (ms) of one query at a time, in alternating rounds."""
    from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig

    encoders = {
        name: await TritonEncoder.connect(TritonEncoderConfig(url)) for name, url in urls.items()
    }
    samples: dict[str, list[float]] = {name: [] for name in urls}
    try:
        for enc in encoders.values():
            for text in texts[:10]:
                await enc.encode([text], "query")
        for r in range(rounds):  # ABBA: neither system always runs first
            order = list(encoders.items())
            for name, enc in order if r % 2 == 0 else order[::-1]:
                end = time.perf_counter() + seconds
                i = 0
                while time.perf_counter() < end:
                    start = time.perf_counter()
                    await enc.encode([texts[i % len(texts)]], "query")
                    samples[name].append((time.perf_counter() - start) * 1e3)
                    i += 1
    finally:
        for enc in encoders.values():
            await enc.close()
    return samples


async def _towers_through_triton(
    url: str, checkpoint: Path, queries: list[str], docs: list[str]
) -> dict[str, float]:
    from services.encoder.build.export import row_cosines
    from services.encoder.model import TorchEmbedder
    from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig

    enc = await TritonEncoder.connect(TritonEncoderConfig(url))
    out = {}
    try:
        for kind, texts in (("query", queries), ("document", docs)):
            got = (await enc.encode(texts, kind, timeout=60)).vectors  # type: ignore[arg-type]
            want = TorchEmbedder(checkpoint / kind).embed(texts, kind)[0]  # type: ignore[arg-type]
            other = "document" if kind == "query" else "query"
            wrong = TorchEmbedder(checkpoint / other).embed(texts, kind)[0]  # type: ignore[arg-type]
            out[f"{kind}_min_cosine"] = min(row_cosines(got, want))
            out[f"{kind}_vs_other_tower_min_cosine"] = min(row_cosines(got, wrong))
    finally:
        await enc.close()
    return out


def _node_count(onnx_path: Path) -> int:
    """Nodes of the exported graph: the same architecture must give the same graph."""
    import onnx

    return len(onnx.load(str(onnx_path), load_external_data=False).graph.node)


def bench_triton(runs: Path, rounds: int, seconds: float) -> dict[str, Any]:
    from services.corpus.beir import load_beir
    from services.encoder.build.export import export_onnx
    from services.encoder.build.repository import RepositoryConfig, generate_repository
    from services.encoder.model import default_model_dir
    from services.encoder.serve.triton_server import TritonServerConfig, run_triton
    from tests.support.processes import free_port

    data = load_beir(SCIFACT)
    queries = [data.queries[q] for q in sorted(data.queries)[:64]]
    docs = [data.docs[d] for d in data.doc_ids[:32]]
    systems = {"base": default_model_dir(), "sde": runs / "sde", "ade_spl": runs / "ade-spl"}
    systems = {k: v for k, v in systems.items() if k == "base" or complete(v)}
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gtr-bench-train-") as tmp, ExitStack() as stack:
        urls = {}
        for name, ckpt in systems.items():
            onnx = Path(tmp) / name / "model.onnx"
            export_onnx(ckpt, onnx)
            repo = Path(tmp) / name / "repo"
            generate_repository(onnx, repo, RepositoryConfig())
            cfg = TritonServerConfig(
                repo,
                grpc_port=free_port(),
                http_port=free_port(),
                metrics_port=free_port(),
                startup_timeout_s=180,
            )
            handle = stack.enter_context(run_triton(cfg, Path(tmp) / f"{name}.log"))
            urls[name] = handle.grpc_url
        if "sde" in urls:
            samples = asyncio.run(
                _p50_rounds({k: urls[k] for k in ("base", "sde")}, queries, rounds, seconds)
            )
            p50 = {k: float(np.percentile(v, 50)) for k, v in samples.items()}
            onnx_nodes = {k: _node_count(Path(tmp) / k / "model.onnx") for k in ("base", "sde")}
            result["p50"] = {
                "base_ms": round(p50["base"], 2),
                "sde_ms": round(p50["sde"], 2),
                "sde_over_base": round(p50["sde"] / p50["base"], 3),
                "requests": {k: len(v) for k, v in samples.items()},
                "rounds": rounds,
                "seconds_per_round": seconds,
                "onnx_nodes": onnx_nodes,
            }
            ratio = p50["sde"] / p50["base"]
            print(
                f"Triton p50 of one query: base {p50['base']:.2f} ms, trained SDE "
                f"{p50['sde']:.2f} ms (ratio {ratio:.3f}, goal <= 1.05)"
            )
        if "ade_spl" in urls:
            towers = asyncio.run(
                _towers_through_triton(urls["ade_spl"], systems["ade_spl"], queries[:32], docs)
            )
            result["ade_spl_towers"] = {k: round(v, 6) for k, v in towers.items()}
            print(f"ADE-SPL through Triton vs in-process towers: {result['ade_spl_towers']}")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=SCIFACT)
    p.add_argument("--runs", type=Path, required=True, help="one checkpoint folder per arch")
    p.add_argument("--train", action="store_true", help="train the missing variants first")
    p.add_argument("--archs", default=",".join(ARCHS), help="variants, in training order")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default="full",
        help="full: the trainer's defaults; cut: half an epoch, 96-token documents, "
        "a 1,200-document eval sample (for a loaded machine)",
    )
    p.add_argument(
        "--epochs",
        type=float,
        help="train every variant this many epochs instead of the recipe's "
        "(the same for all; the budget note and recipe_flags say so)",
    )
    p.add_argument(
        "--no-eval",
        action="store_true",
        help="keep the quality figures already in --out (measured earlier)",
    )
    p.add_argument(
        "--triton",
        action="store_true",
        help="measure the Triton figures (else keep those in --out)",
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=3.0, help="per round and system")
    p.add_argument("--plots", type=Path, default=Path("docs/img/encoder-train"))
    p.add_argument("--out", type=Path, default=Path("bench/results/encoder_train.json"))
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    archs = tuple(a for a in args.archs.split(",") if a)
    command = "python -m bench.encoder_train " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # Sections not measured by this run are kept, each with the command that measured it.
    report: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    recipe = RECIPES[args.recipe] + (["--epochs", f"{args.epochs:g}"] if args.epochs else [])
    if args.train:
        train_missing(args.runs, args.data, args.threads, archs, recipe)
    if not args.no_eval:
        from services.encoder.train.evaluate import compare, table

        done = [args.runs / a for a in archs if complete(args.runs / a)]
        quality = compare(args.data, done, plots=args.plots, progress=False)
        quality["budget"] = FULL_NOTE if args.recipe == "full" else CUT_NOTE
        if args.epochs:
            quality["budget"] = (
                quality["budget"]
                .replace("one epoch", f"{args.epochs:g} epochs (--epochs)")
                .replace("0.5 epoch instead of 1", f"{args.epochs:g} epochs (--epochs)")
            )
        quality["recipe_flags"] = recipe
        quality["not_run"] = [a for a in archs if not complete(args.runs / a)]
        quality["measured_by"] = {"command": command, "at": now}
        report = {**{k: v for k, v in report.items() if k == "triton"}, **quality}
        print(table(quality))
    if args.triton:
        report["triton"] = bench_triton(args.runs, args.rounds, args.seconds)
        report["triton"]["measured_by"] = {"command": command, "at": now}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps(
            {k: report.get(k) for k in ("base", "variants", "triton")}, separators=(",", ":")
        )
    )
    return report


if __name__ == "__main__":
    main()
