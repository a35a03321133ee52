"""The Python client of a running gateway: how to reach it and the calls the tools make.

:class:`Gateway` (address, bearer token, TLS) and :func:`gateway_channel` (retry policy,
TLS, token), :func:`resolve_gateway` (the client flags, the environment, the local
stack's ``stack.json``), and the calls: :func:`ingest_file`, :func:`upsert`,
:func:`search_once`, with :func:`format_hits` for a table. The ``gtr-retrieval``
client commands (:mod:`services.cli.client_commands`), ``up``
(:mod:`services.stack.launcher`) and ``eval --gateway`` use it; it imports none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import textwrap
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from retrieval.v1 import (
    common_pb2,
    documents_pb2,
    documents_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)
from services.rpc.auth import bearer_metadata
from services.rpc.retry import RetryPolicy, channel_options
from services.rpc.settings import ServiceSettings
from services.rpc.tls import ClientTLS
from services.rpc.tls import channel as tls_channel

DEFAULT_RUN_DIR = ".run"
# Every call of the CLI is idempotent (an upsert of the same documents included), so the
# channel retries them all: UNAVAILABLE (the gateway restarting) and RESOURCE_EXHAUSTED
# (its in-flight limit: try again later), 5 attempts, 0.2 s backoff doubling to 2 s,
# all within the call's --timeout (see services/rpc/retry.py). A refusal over the
# limit carries gRPC's pushback (the gateway's retry-after-ms), which gRPC waits instead
# of the backoff; a full store's says "no retry" (services/rpc/status.py).
RETRY = RetryPolicy(
    attempts=5,
    initial_backoff_s=0.2,
    max_backoff_s=2.0,
    codes=("UNAVAILABLE", "RESOURCE_EXHAUSTED"),
)
GATEWAY_SERVICES = ("retrieval.v1.SearchService", "retrieval.v1.DocumentService")
# What the channel receives: as much as the gateway sends by default (--max-message-mb),
# not gRPC's 4 MB default, which a search with many hits and their documents passes
# (10 queries x k=1000 of SciFact abstracts: ~15 MB). See search.proto's BatchSearchRequest.
MAX_ANSWER_BYTES = ServiceSettings.model_fields["max_message_mb"].default * 1024 * 1024


class _Bearer(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._metadata = bearer_metadata(token)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = [*(details.metadata or ()), *self._metadata]
        return continuation(details._replace(metadata=metadata), request)


def gateway_channel(
    address: str,
    policy: RetryPolicy = RETRY,
    *,
    token: str | None = None,
    tls: ClientTLS | None = None,
) -> grpc.Channel:
    """A channel to the gateway that retries by ``policy``, speaks TLS by ``tls`` and
    sends ``token`` as a bearer token on every call."""
    options = [
        *channel_options(GATEWAY_SERVICES, policy),
        ("grpc.max_receive_message_length", MAX_ANSWER_BYTES),
    ]
    channel = tls_channel(address, tls, options=options)
    return grpc.intercept_channel(channel, _Bearer(token)) if token else channel


@dataclass(frozen=True)
class Gateway:
    """Where the gateway is and how to reach it: its address, the bearer token to send
    (None: none) and the TLS of the channel (None: plaintext)."""

    address: str
    token: str | None = None
    tls: ClientTLS | None = None

    def channel(self, policy: RetryPolicy = RETRY) -> grpc.Channel:
        return gateway_channel(self.address, policy, token=self.token, tls=self.tls)


def _stack_state(run_dir: str) -> dict[str, Any]:
    state = Path(run_dir) / "stack.json"
    return dict(json.loads(state.read_text(encoding="utf-8"))) if state.exists() else {}


def stack_run_dir(explicit: str | None = None) -> str:
    """The local stack's run directory: --run-dir, else $GTR_RUN_DIR, else ``.run`` (the
    default of ``up --run-dir``)."""
    return explicit or os.environ.get("GTR_RUN_DIR") or DEFAULT_RUN_DIR


def gateway_address(explicit: str | None, run_dir: str = DEFAULT_RUN_DIR) -> str:
    """--gateway, else $GTR_GATEWAY_ADDRESS, else the running local stack, else :50051."""
    if explicit:
        return explicit
    if os.environ.get("GTR_GATEWAY_ADDRESS"):
        return os.environ["GTR_GATEWAY_ADDRESS"]
    state = _stack_state(run_dir)
    if state:
        return str(state["gateway"])
    return "127.0.0.1:50051"


def resolve_gateway(args: argparse.Namespace, run_dir: str | None = None) -> Gateway:
    """The gateway of a client command: address as :func:`gateway_address`; the token
    from --token, else $GTR_TOKEN, else (talking to the local stack started with
    ``up --auth``) its write token; TLS from --tls-ca/--tls-client-cert/--tls-client-key,
    else $GTR_TLS_CA/$GTR_TLS_CLIENT_CERT/$GTR_TLS_CLIENT_KEY, else the local stack's
    (``up --tls``). The local stack is the one whose ``stack.json`` is in ``run_dir``,
    else in the command's --run-dir (``args.stack_run_dir``), as :func:`stack_run_dir`."""
    run_dir = run_dir or stack_run_dir(getattr(args, "stack_run_dir", None))
    address = gateway_address(args.gateway, run_dir)
    stack = _stack_state(run_dir)
    local = bool(stack) and stack.get("gateway") == address
    token = args.token or os.environ.get("GTR_TOKEN") or None
    if token is None and local and stack.get("write_tokens_file"):
        token = Path(stack["write_tokens_file"]).read_text(encoding="utf-8").split()[0]
    local_tls = stack.get("client_tls") or {} if local else {}
    try:
        tls = ClientTLS.from_paths(
            args.tls_ca or os.environ.get("GTR_TLS_CA") or local_tls.get("ca"),
            args.tls_client_cert or os.environ.get("GTR_TLS_CLIENT_CERT") or local_tls.get("cert"),
            args.tls_client_key or os.environ.get("GTR_TLS_CLIENT_KEY") or local_tls.get("key"),
        )
        if tls is not None:
            tls.check()
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return Gateway(address, token, tls)


def _target(address: str | Gateway) -> Gateway:
    return address if isinstance(address, Gateway) else Gateway(address)


def _batches(docs: Iterator[documents_pb2.Document], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def length_sorted(docs: Iterator[Any], window: int = 4096) -> Iterator[Any]:
    """Documents sorted by length within windows: batches of similar length waste far
    less of the encoder's time on padding (the order of upserts does not matter)."""
    buffer: list[Any] = []
    for doc in docs:
        buffer.append(doc)
        if len(buffer) == window:
            yield from sorted(buffer, key=lambda d: len(d.title) + len(d.text))
            buffer = []
    yield from sorted(buffer, key=lambda d: len(d.title) + len(d.text))


def upsert(
    stub: documents_pb2_grpc.DocumentServiceStub,
    docs: Sequence[documents_pb2.Document],
    timeout: float,
) -> documents_pb2.UpsertResponse:
    """One Upsert; the channel (:func:`gateway_channel`) retries it."""
    return stub.Upsert(documents_pb2.UpsertRequest(documents=docs), timeout=timeout)


def ingest_file(
    address: str | Gateway,
    path: str,
    batch: int = 64,
    parallel: int = 2,
    limit: int | None = None,
    timeout: float = 120.0,
    progress: bool = True,
) -> int:
    """Upsert the corpus at ``path``; returns the number of documents upserted."""
    from tqdm import tqdm

    from services.corpus.readers import count_lines, read_corpus

    total = count_lines(path) if limit is None else limit
    docs = (
        documents_pb2.Document(id=d.id, title=d.title, text=d.text, metadata=d.metadata)
        for d in length_sorted(read_corpus(path, limit=limit))
    )
    done = 0
    with (
        _target(address).channel() as channel,
        ThreadPoolExecutor(max_workers=max(1, parallel)) as pool,
        tqdm(total=total, unit="doc", desc="ingest", disable=not progress) as bar,
    ):
        stub = documents_pb2_grpc.DocumentServiceStub(channel)
        pending: list[Future[documents_pb2.UpsertResponse]] = []
        sizes: list[int] = []
        for chunk in _batches(docs, max(1, min(batch, 256))):
            pending.append(pool.submit(upsert, stub, chunk, timeout))
            sizes.append(len(chunk))
            while len(pending) >= parallel * 2:
                pending.pop(0).result()
                n = sizes.pop(0)
                done += n
                bar.update(n)
        for fut, n in zip(pending, sizes, strict=True):
            fut.result()
            done += n
            bar.update(n)
    return done


def parse_filter(items: Sequence[str]) -> common_pb2.Filter:
    must = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise SystemExit(f"--filter {item!r}: expected KEY=VALUE[,VALUE...]")
        must.append(common_pb2.FieldCondition(key=key, any_of=values.split(",")))
    return common_pb2.Filter(must=must)


def search_once(
    address: str | Gateway, query: str, k: int = 5, timeout: float = 10.0, **options: Any
) -> search_pb2.SearchResponse:
    request = search_request(query, k, **options)
    with _target(address).channel() as channel:
        return search_pb2_grpc.SearchServiceStub(channel).Search(request, timeout=timeout)


def search_request(query: str, k: int = 5, **options: Any) -> search_pb2.SearchRequest:
    """The SearchRequest of the ``search`` command's options (consistency, filters,
    rerank, depth, mode, fusion, rrf_k, dense_weight, candidates; None or absent: the
    gateway's default)."""
    consistency = {
        "eventual": common_pb2.CONSISTENCY_EVENTUAL,
        "strong": common_pb2.CONSISTENCY_STRONG,
    }[options.get("consistency", "eventual")]
    request = search_pb2.SearchRequest(
        query=query,
        k=k,
        consistency=consistency,
        filter=parse_filter(options.get("filters", [])),
        rerank=search_pb2.RerankOptions(
            enabled=bool(options.get("rerank")), depth=int(options.get("depth", 0))
        ),
    )
    if options.get("mode"):
        request.mode = search_pb2.RetrievalMode.Value(f"RETRIEVAL_MODE_{options['mode'].upper()}")
    if options.get("fusion"):
        request.fusion.method = search_pb2.FusionMethod.Value(
            f"FUSION_METHOD_{options['fusion'].upper()}"
        )
    if options.get("rrf_k") is not None:
        request.fusion.rrf_k = options["rrf_k"]
    if options.get("dense_weight") is not None:
        request.fusion.dense_weight = options["dense_weight"]
    if options.get("candidates") is not None:
        request.fusion.candidates = options["candidates"]
    return request


def format_hits(query: str, response: search_pb2.SearchResponse, width: int | None = None) -> str:
    width = width or max(80, min(140, shutil.get_terminal_size((100, 20)).columns))
    t = response.timings
    head = (
        f'"{query}"  ({len(response.hits)} hits, {t.total_ms:.0f} ms: encode '
        f"{t.encode_ms:.0f}, search {t.search_ms:.0f}, fetch {t.fetch_ms:.0f}"
        + (f", rerank {t.rerank_ms:.0f}" if response.reranked else "")
        + (
            f"; {search_pb2.RetrievalMode.Name(response.mode)[15:].lower()}"
            if response.mode
            else ""
        )
        + (
            f" ({search_pb2.FusionMethod.Name(response.fusion.method)[14:].lower()})"
            if response.HasField("fusion")
            else ""
        )
        + (f"; model {response.model}" if response.model else "; query not encoded")
        + (f", generation {response.generation}" if response.generation else "")
        + ("; query embedding from the cache" if response.embedding_cached else "")
        + ")"
    )
    if response.partial and response.missing_shards:
        head += f"  PARTIAL: shards {list(response.missing_shards)} missing"
    if response.sparse_missing_shards:
        head += f"  PARTIAL: shards {list(response.sparse_missing_shards)} answered dense only"
    if response.rerank_skipped:
        head += f"  NOT RERANKED: {response.rerank_skipped_reason}"
    lines = [head]
    title_w = min(40, max((len(h.title or h.id) for h in response.hits), default=10))
    snippet_w = max(20, width - title_w - 16)
    lines.append(f"{'#':>2}  {'score':>6}  {'title':<{title_w}}  text")
    for rank, hit in enumerate(response.hits, 1):
        title = (hit.title or hit.id)[:title_w]
        snippet = " ".join(hit.text.split())
        snippet = textwrap.shorten(snippet, snippet_w, placeholder=" …") if snippet else ""
        lines.append(f"{rank:>2}  {hit.score:6.3f}  {title:<{title_w}}  {snippet}")
    return "\n".join(lines)
