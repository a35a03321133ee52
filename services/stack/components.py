"""How the local stack starts each component (argv, environment, readiness)."""

from __future__ import annotations

import shutil
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from services.stack.children import Child, free_port, grpc_healthy
from services.stack.config import StackConfig

if TYPE_CHECKING:
    from services.stack.launcher import Endpoints

CLI = [sys.executable, "-m", "services.cli.main"]


def redis_child(cfg: StackConfig) -> Child:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(binary).exists():
        raise SystemExit("redis-server is not installed: run scripts/bootstrap.sh")
    cfg.redis_dir.mkdir(parents=True, exist_ok=True)
    port = free_port(cfg.host)
    argv = [
        binary, "--port", str(port), "--bind", cfg.host, "--dir", str(cfg.redis_dir.resolve()),
        "--appendonly", "yes", "--appendfsync", cfg.redis_fsync, "--save", "",
        "--daemonize", "no", "--protected-mode", "no",
    ]  # fmt: skip
    child = Child("redis", argv, cfg.logs / "redis.log")
    child.address = f"redis://{cfg.host}:{port}/0"
    return child


def _redis(url: str):  # type: ignore[no-untyped-def]
    from services.common.redis_client import sync_client

    return sync_client(url, socket_timeout=2.0)


def redis_ready(child: Child) -> bool:
    import redis

    try:
        return bool(_redis(child.address).ping())
    except redis.RedisError:
        return False


def redis_get(url: str, key: str) -> str | None:
    value = _redis(url).get(key)
    return value.decode() if value is not None else None


def redis_set(url: str, key: str, value: str) -> None:
    _redis(url).set(key, value)


def grpc_ready(child: Child) -> bool:
    return grpc_healthy(child.address)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def triton_ready(http_address: str, model: str) -> bool:
    return http_ok(f"http://{http_address}/v2/models/{model}/ready")


def corpus_file(cfg: StackConfig) -> Path:
    """The corpus to ingest: the given file, or the stdlib documentation written once."""
    if cfg.corpus is not None:
        if not cfg.corpus.exists():
            raise SystemExit(f"corpus file {cfg.corpus} does not exist")
        return cfg.corpus
    path = cfg.run_dir / "corpus" / "stdlib.jsonl"
    if not path.exists():
        from services.corpus.stdlib import collect_in_subprocess, write_jsonl

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_jsonl(collect_in_subprocess(), str(tmp))
        tmp.replace(path)
    return path


def gateway_child(cfg: StackConfig, endpoints: Endpoints) -> tuple[Child, str]:
    port = cfg.gateway_port or free_port(cfg.host)
    metrics_port = free_port(cfg.host)
    argv = [
        *CLI, "gateway", "serve",
        "--host", cfg.host, "--port", str(port), "--metrics-port", str(metrics_port),
        "--redis-url", endpoints.redis_url,
        "--shards", ";".join(",".join(r) for r in endpoints.shards),
    ]  # fmt: skip
    if cfg.encoder == "triton":
        argv += ["--encoder", "triton", "--triton-url", endpoints.triton_grpc]
    else:
        argv += ["--encoder", "inprocess"]
    if endpoints.rerank:
        argv += ["--rerank-url", endpoints.rerank]
    child = Child("gateway", argv, cfg.logs / "gateway.log", job="gateway")
    child.address = f"{cfg.host}:{port}"
    child.metrics = f"{cfg.host}:{metrics_port}"
    return child, f"{cfg.host}:{metrics_port}"


Say = Callable[[str], None]


def onnx_export(cfg: StackConfig, say: Say) -> Path:
    """The ONNX export of the default model, made once and cached under the run dir."""
    from services.encoder.export import export_onnx
    from services.encoder.model import default_model_dir

    onnx_path = cfg.run_dir / "export" / "model.onnx"
    if not (onnx_path.exists() and (onnx_path.parent / "encoder.json").exists()):
        say("encoder    exporting the default model to ONNX (first run only)")
        export_onnx(default_model_dir(), onnx_path)
    return onnx_path


def triton_child(cfg: StackConfig, say: Say) -> tuple[Child, str, str, str]:
    """(child, gRPC address, HTTP address, metrics address) of a Triton serving ``embed``."""
    from services.encoder.repository import generate_repository
    from services.encoder.triton_server import TritonServerConfig, triton_command

    generate_repository(onnx_export(cfg, say), cfg.model_repository)
    ports = [free_port(cfg.host) for _ in range(3)]
    server = TritonServerConfig(
        model_repository=cfg.model_repository,
        grpc_port=ports[0],
        http_port=ports[1],
        metrics_port=ports[2],
        host=cfg.host,
        backend_dir=cfg.run_dir / "triton-backends",
    )
    argv, env = triton_command(server)
    child = Child("triton", argv, cfg.logs / "triton.log", env=env, job="triton")
    child.address = server.grpc_url
    child.metrics = f"{cfg.host}:{ports[2]}"
    return child, server.grpc_url, f"{cfg.host}:{ports[1]}", f"{cfg.host}:{ports[2]}"


def _encode_sample(cfg: StackConfig, triton_grpc: str, texts: list[str]) -> tuple[object, str]:
    """Embed ``texts`` (document side) through Triton, or in-process without it."""
    import asyncio

    import numpy as np

    async def run() -> tuple[object, str]:
        if triton_grpc:
            from services.encoder.triton_client import TritonEncoder, TritonEncoderConfig

            encoder: object = await TritonEncoder.connect(
                TritonEncoderConfig(url=triton_grpc, default_timeout_s=120.0)
            )
        else:
            from services.encoder.inprocess import InProcessEncoder

            encoder = InProcessEncoder.torch()
        try:
            step = encoder.max_batch  # type: ignore[attr-defined]
            rows = [
                (await encoder.encode(texts[i : i + step], "document")).vectors  # type: ignore[attr-defined]
                for i in range(0, len(texts), step)
            ]
            return np.concatenate(rows), encoder.model_name  # type: ignore[attr-defined]
        finally:
            await encoder.close()  # type: ignore[attr-defined]

    return asyncio.run(run())


def train_index_if_needed(cfg: StackConfig, triton_grpc: str, say: Say) -> None:
    """First run: train IVF-PQ on a sample of the corpus's own embeddings."""
    import random

    import numpy as np

    from services.corpus.readers import read_corpus
    from services.index.core.train import MANIFEST, TrainOptions, train_index

    if (cfg.index_dir / MANIFEST).exists():
        return
    corpus = corpus_file(cfg)
    docs = list(read_corpus(corpus))
    random.Random(0).shuffle(docs)
    sample = docs[: cfg.train_sample]
    say(f"index      training IVF-PQ on {len(sample)} embeddings of {corpus.name} (first run)")
    texts = sorted((f"{d.title} {d.text}" if d.title else d.text for d in sample), key=len)
    vectors, model = _encode_sample(cfg, triton_grpc, texts)
    manifest = train_index(np.asarray(vectors), cfg.index_dir, TrainOptions(model=str(model)))
    say(f"index      {manifest.factory}, nprobe {manifest.nprobe}")


def shard_child(cfg: StackConfig, shard: int, replica: int, redis_url: str) -> Child:
    port, metrics_port = free_port(cfg.host), free_port(cfg.host)
    name = f"shard-{shard}-replica-{replica}"
    argv = [
        *CLI, "index", "serve",
        "--host", cfg.host, "--port", str(port),
        "--shard", str(shard), "--shards", str(cfg.shards), "--replica", name,
        "--redis-url", redis_url, "--index-dir", str(cfg.index_dir),
        "--snapshot-dir", str(cfg.snapshot_dir(shard, replica)),
        "--metrics-port", str(metrics_port),
        # every replica of every shard shares this machine's cores: search inline
        "--search-threads", "0",
    ]  # fmt: skip
    child = Child(name, argv, cfg.logs / f"{name}.log", job="index")
    child.address = f"{cfg.host}:{port}"
    child.metrics = f"{cfg.host}:{metrics_port}"
    return child


def rerank_child(cfg: StackConfig) -> Child:
    port, metrics_port = free_port(cfg.host), free_port(cfg.host)
    argv = [
        *CLI, "rerank", "serve", "--host", cfg.host, "--port", str(port),
        "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    if cfg.rerank_checkpoint is not None:
        argv += ["--checkpoint", str(cfg.rerank_checkpoint)]
    child = Child("rerank", argv, cfg.logs / "rerank.log", job="rerank")
    child.address = f"{cfg.host}:{port}"
    child.metrics = f"{cfg.host}:{metrics_port}"
    return child


PROMETHEUS_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def prometheus_child(cfg: StackConfig, children: list[Child]) -> Child | None:
    """Prometheus scraping every child, with the SLO rules; None when not installed."""
    import json

    binary = shutil.which("prometheus")
    if binary is None or not (PROMETHEUS_CONFIG / "prometheus.yml").exists():
        return None
    home = cfg.run_dir / "prometheus"
    home.mkdir(parents=True, exist_ok=True)
    for name in ("prometheus.yml", "rules.yml"):
        shutil.copy2(PROMETHEUS_CONFIG / name, home / name)
    targets = [
        {"targets": [c.metrics], "labels": {"job": c.job, "instance": c.name}}
        for c in children
        if c.metrics and c.job
    ]
    (home / "targets.json").write_text(json.dumps(targets, indent=2), encoding="utf-8")
    port = free_port(cfg.host)
    argv = [
        binary, f"--config.file={(home / 'prometheus.yml').resolve()}",
        f"--storage.tsdb.path={(home / 'data').resolve()}",
        f"--web.listen-address={cfg.host}:{port}",
    ]  # fmt: skip
    child = Child("prometheus", argv, cfg.logs / "prometheus.log")
    child.address = f"{cfg.host}:{port}"
    return child
