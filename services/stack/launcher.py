"""``gtr-retrieval up``: the whole system on this machine, as child processes.

Order: Redis → Triton (encoder) → first run only: the corpus encoded once and the index
trained on a sample of those embeddings (:mod:`services.stack.first_run`) → shards →
rerank → gateway → first run only: the corpus stored with those embeddings (no second
encode; a corpus not yet ingested on a later run goes through the gateway) → example
searches → serve until
Ctrl-C/SIGTERM, then stop the children in reverse order. Meanwhile a child that exits is
restarted on the same port (see :mod:`services.stack.children`); one that keeps failing
stops the whole stack (exit status 1). Every child logs to
``<run_dir>/logs/<name>.log``; ``<run_dir>/stack.json`` says where everything listens,
and each child's pid, state and restart count.
State (Redis AOF, the trained index, shard snapshots) lives in the run directory, so a
second ``up`` resumes where the first one stopped.
"""

from __future__ import annotations

import _thread
import functools
import hashlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from services.index.keys import FIRST_GENERATION
from services.process.private import PRIVATE_UMASK, make_private
from services.process.redis_client import parse_redis_url
from services.rpc.tls import ClientTLS
from services.stack import components, first_run, prometheus_component, triton_component
from services.stack.children import STOP_GRACE_S, Child, ChildFailed, Spawn, Supervisor
from services.stack.config import StackConfig, example_queries
from services.stack.endpoints import Endpoints
from services.stack.generations import GenerationShards

if TYPE_CHECKING:
    from services.client.gateway import Gateway

log = logging.getLogger(__name__)


def _say(message: str) -> None:
    print(f"[up] {message}", flush=True)


def _public(address: str) -> str:
    """``address`` without a password (Redis's URL carries one under ``--auth``)."""
    return parse_redis_url(address).safe_url if "@" in address else address


def corpus_fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.supervisor = Supervisor(
            config.restart, report=_say, on_change=self._publish, on_give_up=self._gave_up
        )
        self.endpoints = Endpoints()
        self._stop = threading.Event()
        self._published = False  # stack.json is written (start-up done, not stopped)
        self._state_lock = threading.Lock()
        self._first_run: first_run.CorpusEmbeddings | None = None  # until stored
        self.generations: GenerationShards | None = None  # the shards of every generation
        self._redis_url = ""  # the whole URL (password included): never printed or published

    # --- lifecycle -------------------------------------------------------------------

    def run(self) -> int:
        cfg = self.config
        first_run.check_trainable(cfg)  # a corpus too small to train on: before anything
        umask = os.umask(PRIVATE_UMASK)  # inherited by every child (Redis's AOF included)
        make_private(cfg.run_dir)
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self.supervisor.watch()
            self.start()
            if self.generations is not None:
                self.generations.watch()  # from now on: rollouts' targets, retirements
            corpus = self.ingest()
            self.print_endpoints(corpus)
            self.examples()
            if cfg.serve:
                _say("serving; Ctrl-C stops everything")
                return self.wait()
            return 0
        except ChildFailed as exc:
            _say(f"failed: {exc}")
            return 1
        except KeyboardInterrupt:
            if self.supervisor.failure is not None:
                return 1  # a child kept failing (the supervisor said which)
            return 0 if self._stop.is_set() else 130  # a requested stop is a clean exit
        finally:
            self._stop.set()  # from here on a signal (or the supervisor) interrupts nothing
            _say("stopping")
            if self.generations is not None:
                self.generations.halt()  # no generation starts from here on
            killed = self.supervisor.stop_all()
            if self.generations is not None:
                self.generations.close()
            if killed:
                _say(f"killed (no exit {STOP_GRACE_S:.0f} s after SIGTERM): {', '.join(killed)}")
            restarts = {n: k for n, k in self.supervisor.restart_counts().items() if k}
            if restarts:
                _say("restarts   " + ", ".join(f"{n} {k}" for n, k in restarts.items()))
            with self._state_lock:
                self._published = False
                (cfg.run_dir / "stack.json").unlink(missing_ok=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.umask(umask)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        raise KeyboardInterrupt

    def _gave_up(self, message: str) -> None:
        """The supervisor stopped everything (a child kept failing): end ``run``."""
        if not self._stop.is_set():
            _thread.interrupt_main(signal.SIGINT)  # like Ctrl-C, wherever run() is

    def wait(self) -> int:
        """Serve until a stop is requested (0) or the supervisor gives up (1)."""
        while not self._stop.wait(1.0):
            if self.supervisor.failure is not None:
                return 1
        return 0

    def _publish(self) -> None:
        """(Re)write ``stack.json``: the endpoints, and each child's pid, state, restarts."""
        with self._state_lock:
            if not self._published:
                return
            if self.generations is not None:
                self.endpoints.generations = self.generations.addresses()
            children = [
                {
                    "name": c.name,
                    "address": _public(c.address),
                    "pid": c.pid,
                    "state": c.state.value,
                    "restarts": c.restarts,
                    "log": str(c.log_path),
                }
                for c in self.supervisor.children
            ]
            state = {
                **self.endpoints.as_json(),
                "restarts": self.supervisor.restart_counts(),
                "children": children,
            }
            path = self.config.run_dir / "stack.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(state, indent=2), encoding="utf-8")
            tmp.replace(path)

    def gateway(self) -> Gateway:
        """The gateway as the launcher's own client reaches it (token, TLS)."""
        from services.client.gateway import Gateway
        from services.rpc.tls import ClientTLS

        e = self.endpoints
        token = None
        if e.write_tokens_file:
            token = Path(e.write_tokens_file).read_text(encoding="utf-8").split()[0]
        tls = ClientTLS(e.client_tls["ca"]) if e.client_tls else None
        return Gateway(e.gateway, token, tls)

    def _security(self) -> ClientTLS | None:
        """Token files and certificates (made on the first run); says what is on."""
        cfg = self.config
        token_files = components.tokens(cfg)
        if token_files is None:
            _say(
                f"auth       off (local stack on loopback {cfg.host}; "
                "pass --auth to require tokens)"
            )
        else:
            self.endpoints.read_tokens_file = str(token_files[0].resolve())
            self.endpoints.write_tokens_file = str(token_files[1].resolve())
            _say(f"auth       bearer tokens: read {token_files[0]}, write {token_files[1]}")
        certs = components.certificates(cfg)
        if certs is None:
            _say("tls        off (pass --tls for TLS, and mTLS between the services)")
            return None
        self.endpoints.client_tls = {"ca": str(certs.ca.resolve())}
        self.endpoints.internal_tls = {
            "ca": str(certs.ca.resolve()),
            "cert": str(certs.client_cert.resolve()),
            "key": str(certs.client_key.resolve()),
        }
        _say(f"tls        gateway TLS, mTLS between the services and Triton; CA {certs.ca}")
        return components.internal_tls(cfg)

    def _fork_server(self) -> Spawn | None:
        """The fork server's spawn for shard processes (``fork_shards``), started now: it
        imports in the background, and the first shard's fork waits for that."""
        if not self.config.fork_shards:
            return None
        from services.stack.forking import ForkServer

        server = ForkServer()
        server.start()
        return server.spawn

    def start(self) -> None:
        cfg = self.config
        timeout = cfg.startup_timeout_s
        spawn = self._fork_server()  # first: its imports overlap Redis's and Triton's start
        tls = self._security()
        if cfg.otlp_endpoint:
            traced = cfg.triton_otlp_endpoint or "not traced (--triton-otlp-endpoint)"
            _say(
                f"tracing    spans to {cfg.otlp_endpoint}, ratio {cfg.trace_sample_ratio:g}; "
                f"Triton {traced}"
            )
        redis = components.redis_child(cfg)
        self.supervisor.start(redis, lambda: components.redis_ready(redis), timeout)
        self._redis_url = redis.address
        self.endpoints.redis_url = parse_redis_url(redis.address).safe_url
        self.endpoints.redis_url_file = str(cfg.redis_url_file.resolve())
        locked = ", password required" if cfg.auth else ""
        locked += ", TLS with client certificates" if cfg.tls else ""
        _say(f"redis      {self.endpoints.redis_url}  (data {cfg.redis_dir}{locked})")
        components.migrate_redis_if_needed(redis.address, cfg.shards, _say)

        if cfg.encoder == "triton":
            _say("triton     generating the CPU model repository and starting tritonserver")
            triton, grpc_address, metrics = triton_component.triton_child(cfg, _say)
            ready = functools.partial(triton_component.triton_ready, grpc_address, "embed", tls)
            self.supervisor.start(triton, ready, timeout)
            self.endpoints.triton_grpc = grpc_address
            self.endpoints.triton_metrics = metrics
            self.endpoints.triton_repository = str(cfg.model_repository.resolve())
            weight = f", session nice {triton.nice}: searches first" if triton.nice else ""
            _say(f"triton     {grpc_address}  (model 'embed'{weight})")

        self._first_run = self.train_if_needed()

        # generation g1 (the stack's own index) recorded before any shard starts, then the
        # shards of every generation that runs (a rollout's target too), serving one first
        serving = self.record_first_generation()
        self.endpoints.index_root = str(cfg.index_root.resolve())
        self.generations = GenerationShards(
            cfg,
            self.supervisor,
            redis.address,
            tls=tls,
            report=_say,
            on_change=self._generations_changed,
            spawn=spawn,
        )
        self.generations.start_all()
        self.endpoints.shards = self.generations.gateway_shards()
        self.endpoints.generations = self.generations.addresses()
        gens = self.endpoints.generations
        running = ", ".join(f"{name} ({len(shards)} shard(s))" for name, shards in gens.items())
        _say(f"index      {running}, {cfg.replicas} replica(s) per shard; serving {serving}")

        if cfg.rerank:
            rerank = components.rerank_child(cfg)
            self.supervisor.start(rerank, lambda: components.grpc_ready(rerank, tls), timeout)
            self.endpoints.rerank = rerank.address

        gateway, metrics_address = components.gateway_child(cfg, self.endpoints)
        public = ClientTLS(tls.ca) if tls is not None else None  # TLS, no client certificate
        self.supervisor.start(gateway, lambda: components.grpc_ready(gateway, public), timeout)
        self.endpoints.gateway = gateway.address
        self.endpoints.gateway_metrics = metrics_address
        if cfg.prometheus:
            prom = prometheus_component.prometheus_child(cfg, self.supervisor.children)
            if prom is not None:
                url = f"http://{prom.address}/-/ready"
                self.supervisor.start(prom, functools.partial(components.http_ok, url), timeout)
                self.endpoints.prometheus = f"http://{prom.address}"
        with self._state_lock:
            self._published = True
        self._publish()

    def record_first_generation(self) -> str:
        """Generation g1 in the registry (once per store): the stack's shard count, its
        trained index, and the encoder it was trained with (Triton's ``embed`` version
        serving now, pinned: a version published later must not change g1's vectors).
        Returns the serving generation's name."""
        from services.generations.registry import Registry

        cfg = self.config
        client = components._redis(self._redis_url)
        try:
            registry = Registry(client)
            if not any(g.name == FIRST_GENERATION for g in registry.all()):
                encoder = first_run.encoder_spec(cfg, self.endpoints.triton_grpc)
                g1 = registry.ensure_first(cfg.shards, encoder, str(cfg.index_dir.resolve()))
                _say(
                    f"generation {g1.name} recorded: {g1.num_shards} shard(s), encoder "
                    f"{g1.encoder.model} version {g1.encoder.version or 'any'} "
                    f"({g1.encoder.dim}-d)"
                )
            return registry.alias().serving
        finally:
            client.close()

    def _generations_changed(self) -> None:
        """A generation's shards started or stopped: stack.json and Prometheus follow."""
        self._publish()
        if self.config.prometheus:
            prometheus_component.write_prometheus_targets(self.config, self.supervisor.children)

    def train_if_needed(self) -> first_run.CorpusEmbeddings | None:
        """First run (no trained index): encode the corpus once, train on a sample of it;
        the embeddings are kept for :meth:`ingest` (:mod:`services.stack.first_run`)."""
        from services.index.core.trained import MANIFEST

        cfg = self.config
        if (cfg.index_dir / MANIFEST).exists():
            return None
        corpus = components.corpus_file(cfg)
        embeddings = first_run.encode_corpus(cfg, corpus, self.endpoints.triton_grpc, _say)
        first_run.train_on(cfg, embeddings, _say)
        return embeddings

    def ingest(self) -> Path:
        cfg = self.config
        corpus = components.corpus_file(cfg)
        marker = f"stack:ingested:{corpus_fingerprint(corpus)}"
        if components.redis_get(self._redis_url, marker):
            _say(f"corpus     {corpus} already ingested")
            return corpus
        if self._first_run is not None and self._first_run.corpus == corpus:
            _say(f"ingest     {corpus} with the first run's embeddings (encoded once)")
            start = time.perf_counter()
            n = first_run.store_documents(
                self._redis_url, cfg.shards, self._first_run, cfg.progress
            )
            self._first_run = None
            components.redis_set(self._redis_url, marker, str(n))
            _say(f"ingest     {n} documents in {time.perf_counter() - start:.1f} s")
            return corpus
        from services.client.gateway import ingest_file

        _say(f"ingest     {corpus}")
        start = time.perf_counter()
        n = ingest_file(self.gateway(), str(corpus), batch=cfg.ingest_batch, progress=cfg.progress)
        components.redis_set(self._redis_url, marker, str(n))
        _say(f"ingest     {n} documents in {time.perf_counter() - start:.1f} s")
        return corpus

    def examples(self) -> None:
        from services.client.gateway import format_hits, search_once

        queries = example_queries(self.config)
        if not queries:
            _say("examples   none: no queries.jsonl beside the corpus to take them from")
        for query in queries:
            response = search_once(self.gateway(), query, k=3, timeout=30.0, consistency="strong")
            print()
            print(format_hits(query, response))
        print(flush=True)

    def print_endpoints(self, corpus: Path) -> None:
        e = self.endpoints
        rows = [
            ("gateway (gRPC)", e.gateway),
            ("gateway (HTTP/JSON)", e.gateway_http),
            ("gateway metrics", f"http://{e.gateway_metrics}/metrics" if e.gateway_metrics else ""),
            ("triton (KServe v2 gRPC)", e.triton_grpc),
            ("triton metrics", f"http://{e.triton_metrics}/metrics" if e.triton_metrics else ""),
            ("rerank (gRPC)", e.rerank),
            ("prometheus", e.prometheus),
            ("redis", e.redis_url),
            *[
                (f"index {name} shard {s}", ", ".join(r))
                for name, shards in e.generations.items()
                for s, r in enumerate(shards)
            ],
            ("index root (rollouts)", e.index_root),
            ("triton repository", e.triton_repository),
            ("corpus", str(corpus)),
            ("logs", str(self.config.logs)),
        ]
        print()
        for name, where in rows:
            if where:
                print(f"  {name:<24} {where}")
        queries = example_queries(self.config) or ("your query",)
        run_dir = self.config.run_dir
        where = "" if run_dir == StackConfig().run_dir else f" --run-dir {run_dir}"
        print(f'\n  try:  .venv/bin/gtr-retrieval search "{queries[0]}"{where}\n', flush=True)


def run_stack(config: StackConfig) -> int:
    return Stack(config).run()


__all__ = ["Child", "Stack", "StackConfig", "run_stack"]
