"""How the local stack starts each component (argv, environment, readiness); Triton's in
:mod:`.triton_component`, Prometheus's in :mod:`.prometheus_component`."""

from __future__ import annotations

import shutil
import sys
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from services.index.keys import FIRST_GENERATION
from services.process.hold import HOLD_FILE
from services.stack.children import Child, free_port, grpc_healthy
from services.stack.config import StackConfig

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS
    from services.stack.certs import CertFiles
    from services.stack.endpoints import Endpoints

CLI = [sys.executable, "-m", "services.cli.main"]


def redis_child(cfg: StackConfig) -> Child:
    """The stack's Redis. ``--auth``: it requires a password (:func:`redis_password`,
    given to redis-server in a 0600 config file, not on its command line); ``--tls``: it
    serves TLS only (no plaintext port) and requires the run's client certificate, as
    our gRPC servers do. How to reach it (the password and certificates included) is
    written to ``cfg.redis_url_file`` (0600), which every child reads (:func:`redis_args`).
    """
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(binary).exists():
        raise SystemExit("redis-server is not installed: run scripts/bootstrap.sh")
    cfg.redis_dir.mkdir(parents=True, exist_ok=True)
    port = free_port(cfg.host)
    password = redis_password(cfg)
    argv = [binary]
    if password is not None:
        write_secret(cfg.redis_config_file, f"requirepass {password}\n")
        argv.append(str(cfg.redis_config_file.resolve()))  # redis-server [config] [options]
    argv += [
        "--bind",
        cfg.host,
        "--dir",
        str(cfg.redis_dir.resolve()),
        "--appendonly",
        "yes",
        "--appendfsync",
        cfg.redis_fsync,
        "--save",
        "",
        "--daemonize",
        "no",
        "--protected-mode",
        "yes" if password else "no",
    ]
    certs = certificates(cfg)
    scheme, query = "redis", ""
    if certs is None:
        argv += ["--port", str(port)]
    else:
        argv += [
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(certs.server_cert.resolve()),
            "--tls-key-file",
            str(certs.server_key.resolve()),
            "--tls-ca-cert-file",
            str(certs.ca.resolve()),
            "--tls-auth-clients",
            "yes",
        ]
        scheme = "rediss"
        query = "?" + urlencode(
            safe="/",
            query={
                "ssl_ca_certs": certs.ca.resolve(),
                "ssl_certfile": certs.client_cert.resolve(),
                "ssl_keyfile": certs.client_key.resolve(),
            },
        )
    userinfo = f":{password}@" if password else ""
    child = Child("redis", argv, cfg.logs / "redis.log")
    child.address = f"{scheme}://{userinfo}{cfg.host}:{port}/0{query}"
    write_secret(cfg.redis_url_file, child.address + "\n")
    return child


def redis_args(cfg: StackConfig) -> list[str]:
    """How a child of ours is told where the stack's Redis is: the URL file
    (:func:`redis_child` writes it), so no password shows on a command line."""
    return ["--redis-url-file", str(cfg.redis_url_file.resolve())]


def redis_password(cfg: StackConfig) -> str | None:
    """``--auth``: the local Redis's password, generated on first use into the run
    directory (mode 0600) like the tokens; None without ``--auth``."""
    if not cfg.auth:
        return None
    import secrets

    path = cfg.redis_password_file
    if not path.exists():
        write_secret(path, secrets.token_urlsafe(32) + "\n", exclusive=True)
    return path.read_text(encoding="utf-8").strip()


def write_secret(path: Path, text: str, *, exclusive: bool = False) -> None:
    """Write ``text`` to ``path`` with mode 0600 from the start (never readable by
    others, not even for a moment); ``exclusive``: only if it does not exist yet,
    else replaced atomically."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    target = path if exclusive else path.with_name(path.name + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(target, flags, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    if not exclusive:
        os.chmod(target, 0o600)  # an older leftover .tmp kept its mode
        target.replace(path)


def _redis(url: str):  # type: ignore[no-untyped-def]
    from services.process.redis_client import sync_client

    return sync_client(url, socket_timeout=2.0)


def redis_ready(child: Child) -> bool:
    import redis

    client = _redis(child.address)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def redis_get(url: str, key: str) -> str | None:
    client = _redis(url)
    try:
        value = client.get(key)
    finally:
        client.close()
    return value.decode() if value is not None else None


def redis_set(url: str, key: str, value: str) -> None:
    client = _redis(url)
    try:
        client.set(key, value)
    finally:
        client.close()


def migrate_redis_if_needed(url: str, shards: int, say: Callable[[str], None]) -> None:
    """A run directory from before the hash-tagged key layout (or a migration cut short):
    the stack owns this Redis and starts nothing that uses it before this returns, so it
    runs ``gtr-retrieval redis migrate`` itself instead of letting every service refuse."""
    from services.index.layout import read_layout, v1_keys_present
    from services.index.migrate import migrate

    client = _redis(url)
    try:
        layout = read_layout(client)
        if "migrating" in layout or (not layout and v1_keys_present(client, shards)):
            say("redis      an older key layout: migrating it (gtr-retrieval redis migrate)")
            report = migrate(client, shards)
            say(f"redis      migrated {report.documents} documents to key layout 2")
    finally:
        client.close()


def grpc_ready(child: Child, tls: ClientTLS | None = None) -> bool:
    return grpc_healthy(child.address, tls=tls)


def certificates(cfg: StackConfig) -> CertFiles | None:
    """``--tls``: the run directory's throwaway CA and certificates (made on first use)."""
    if not cfg.tls:
        return None
    from services.stack.certs import CertFiles, make_certs

    files = CertFiles(cfg.tls_dir)
    return files if files.exist() else make_certs(cfg.tls_dir)


def internal_tls(cfg: StackConfig) -> ClientTLS | None:
    """How our own clients (the gateway, the launcher's checks) reach our servers:
    trusting the run's CA and presenting its client certificate (mTLS)."""
    from services.rpc.tls import ClientTLS

    certs = certificates(cfg)
    if certs is None:
        return None
    return ClientTLS(certs.ca, certs.client_cert, certs.client_key)


def server_tls_args(cfg: StackConfig, mutual: bool = True) -> list[str]:
    """The --tls-* flags of a server of ours (client certificates required if ``mutual``)."""
    certs = certificates(cfg)
    if certs is None:
        return []
    argv = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    return argv + (["--tls-client-ca", str(certs.ca)] if mutual else [])


def tokens(cfg: StackConfig) -> tuple[Path, Path] | None:
    """``--auth``: (read, write) token files in the run directory, one token each,
    generated on first use (mode 0600)."""
    if not cfg.auth:
        return None
    import secrets

    files = (cfg.auth_dir / "read.tokens", cfg.auth_dir / "write.tokens")
    for path in files:
        if not path.exists():
            write_secret(path, secrets.token_urlsafe(32) + "\n", exclusive=True)
    return files


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


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


def query_cache_args(cfg: StackConfig) -> list[str]:
    """``up --query-cache``: the gateway's cache flags (the cache lives in the stack's
    Redis, beside the documents; it bounds itself by --query-cache-max-entries)."""
    if not cfg.query_cache:
        return []
    argv = ["--query-cache"]
    if cfg.query_cache_ttl_s is not None:
        argv += ["--query-cache-ttl-s", str(cfg.query_cache_ttl_s)]
    if cfg.query_cache_max_entries is not None:
        argv += ["--query-cache-max-entries", str(cfg.query_cache_max_entries)]
    return argv


def tracing_args(cfg: StackConfig) -> list[str]:
    """``up --otlp-endpoint``: the tracing flags of every child of ours (docs/tracing.md)."""
    if not cfg.otlp_endpoint:
        return []
    return [
        "--otlp-endpoint",
        cfg.otlp_endpoint,
        "--trace-sample-ratio",
        str(cfg.trace_sample_ratio),
    ]


def gateway_child(cfg: StackConfig, endpoints: Endpoints) -> tuple[Child, str]:
    port = cfg.gateway_port or free_port(cfg.host)
    metrics_port = free_port(cfg.host)
    http_port = None if cfg.http_port is None else cfg.http_port or free_port(cfg.host)
    # g1's shards; none once g1 is retired (the gateway reads the store's key layout)
    shards = ";".join(",".join(r) for r in endpoints.shards)
    argv = [
        *CLI,
        "gateway",
        "serve",
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        *redis_args(cfg),
        *(["--shards", shards] if shards else []),
        "--max-in-flight",
        str(cfg.max_in_flight),
        *(["--http-port", str(http_port)] if http_port is not None else []),
    ]
    argv += ["--hold-file", str(cfg.run_dir / HOLD_FILE)]  # a rollout paused while searches run
    if cfg.encoder == "triton":
        argv += ["--encoder", "triton", "--triton-url", endpoints.triton_grpc]
        if cfg.query_encoder == "gateway":
            argv += ["--query-repository", str(cfg.model_repository)]
    else:
        argv += ["--encoder", "inprocess"]
    if endpoints.rerank:
        argv += ["--rerank-url", endpoints.rerank]
    argv += query_cache_args(cfg)
    argv += tracing_args(cfg)
    token_files = tokens(cfg)
    if token_files is None:
        argv += ["--no-auth"]  # loopback only; `up` says so
    else:
        argv += ["--read-tokens-file", str(token_files[0])]
        argv += ["--write-tokens-file", str(token_files[1])]
    certs = certificates(cfg)
    if certs is not None:
        # the public side: TLS (clients need the CA, no certificate of their own)
        argv += server_tls_args(cfg, mutual=False)
        # its own channels to shards, rerank and Triton: mTLS
        argv += ["--tls-ca", str(certs.ca), "--tls-client-cert", str(certs.client_cert)]
        argv += ["--tls-client-key", str(certs.client_key)]
    child = Child("gateway", argv, cfg.logs / "gateway.log", job="gateway")
    child.address = f"{cfg.host}:{port}"
    child.metrics = f"{cfg.host}:{metrics_port}"
    if http_port is not None:
        scheme = "https" if certs is not None else "http"
        endpoints.gateway_http = f"{scheme}://{cfg.host}:{http_port}"
    return child, f"{cfg.host}:{metrics_port}"


def peer_tls_args(cfg: StackConfig) -> list[str]:
    """``--tls``: how a shard replica reaches its peers (the run's CA, mTLS)."""
    certs = certificates(cfg)
    if certs is None:
        return []
    return [
        "--tls-ca",
        str(certs.ca),
        "--tls-client-cert",
        str(certs.client_cert),
        "--tls-client-key",
        str(certs.client_key),
    ]


def shard_ports(cfg: StackConfig) -> list[int]:
    """Free ports for the replicas of one shard, chosen together: each replica's
    ``--peers`` names the others (to seed from when the log was trimmed past it)."""
    return [free_port(cfg.host) for _ in range(cfg.replicas)]


@dataclass(frozen=True)
class ShardGroup:
    """Whose shards: a generation's name, its shard count and its trained index (the
    default: generation g1 of the stack's own shard count and index)."""

    generation: str = FIRST_GENERATION
    num_shards: int | None = None  # None: the stack's --shards
    index_dir: Path | None = None  # None: the stack's own (g1's)

    def child_name(self, shard: int, replica: int) -> str:
        name = f"shard-{shard}-replica-{replica}"
        return name if self.generation == FIRST_GENERATION else f"{self.generation}-{name}"


def shard_child(
    cfg: StackConfig,
    shard: int,
    replica: int,
    ports: Sequence[int] = (),
    group: ShardGroup = ShardGroup(),
) -> Child:
    """Replica ``replica`` of ``shard`` of ``group`` (default: generation g1); ``ports``:
    those of all the shard's replicas (:func:`shard_ports`), its own at index ``replica``
    (default: a free port, no peers). Another generation's replica gets ``--generation``,
    its record's shard count and index, and snapshot folders of its own."""
    port = ports[replica] if ports else free_port(cfg.host)
    metrics_port = free_port(cfg.host)
    peers = [f"{cfg.host}:{p}" for i, p in enumerate(ports) if i != replica]
    name = group.child_name(shard, replica)
    num_shards = group.num_shards or cfg.shards
    index_dir = group.index_dir or cfg.index_dir
    generation = [] if group.generation == FIRST_GENERATION else ["--generation", group.generation]
    argv = [
        *CLI,
        "index",
        "serve",
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--shard",
        str(shard),
        "--shards",
        str(num_shards),
        "--replica",
        name,
        *generation,
        *redis_args(cfg),
        "--index-dir",
        str(index_dir),
        "--snapshot-dir",
        str(cfg.snapshot_dir(shard, replica, group.generation)),
        "--metrics-port",
        str(metrics_port),
        # every replica of every shard shares this machine's cores: search inline
        "--search-threads",
        "0",
        "--max-in-flight",
        str(cfg.max_in_flight),
        *(["--peers", ",".join(peers)] if peers else []),
        *peer_tls_args(cfg),
        *server_tls_args(cfg),
        *tracing_args(cfg),
    ]
    child = Child(name, argv, cfg.logs / f"{name}.log", job="index")
    child.address = f"{cfg.host}:{port}"
    child.metrics = f"{cfg.host}:{metrics_port}"
    return child


def rerank_child(cfg: StackConfig) -> Child:
    port, metrics_port = free_port(cfg.host), free_port(cfg.host)
    argv = [
        *CLI,
        "rerank",
        "serve",
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        *server_tls_args(cfg),
        *tracing_args(cfg),
    ]
    if cfg.rerank_checkpoint is not None:
        argv += ["--checkpoint", str(cfg.rerank_checkpoint)]
    if cfg.rerank_checkpoint_dir is not None:
        argv += ["--checkpoint-dir", str(cfg.rerank_checkpoint_dir)]
    child = Child("rerank", argv, cfg.logs / "rerank.log", job="rerank")
    child.address = f"{cfg.host}:{port}"
    child.metrics = f"{cfg.host}:{metrics_port}"
    return child
