"""The tools' use of the SDK (``gtr_client``): where the gateway is and the calls they make.

:class:`Gateway` (address, bearer token, TLS) and its :meth:`Gateway.client` (the SDK's
:class:`gtr_client.Client`: its retries, exceptions, typed results), :func:`resolve_gateway`
(the client flags, the environment variables the SDK reads, the local stack's
``stack.json``), and what the tools do with a client: :func:`ingest_file` (a corpus file
in parallel upserts), :func:`search_once`, with :func:`format_hits` for a table. The
``gtr-retrieval`` client commands (:mod:`services.cli.client_commands`), ``up``
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

import gtr_client
from gtr_client.connection import (
    ENV_ADDRESS,
    ENV_TLS_CA,
    ENV_TLS_CLIENT_CERT,
    ENV_TLS_CLIENT_KEY,
    ENV_TOKEN,
)
from services.rpc.tls import ClientTLS

DEFAULT_RUN_DIR = ".run"


@dataclass(frozen=True)
class Gateway:
    """Where the gateway is and how to reach it: its address, the bearer token to send
    (None: none) and the TLS of the channel (None: plaintext)."""

    address: str
    token: str | None = None
    tls: ClientTLS | None = None

    def client(self, timeout: float = 10.0) -> gtr_client.Client:
        """An SDK client of this gateway (exactly this address, token and TLS: no
        environment variable read), ``timeout`` the deadline of each call."""
        tls = (
            gtr_client.TLS(self.tls.ca, self.tls.cert, self.tls.key, self.tls.server_name)
            if self.tls is not None
            else False
        )
        return gtr_client.Client(
            self.address,
            token=self.token or "",
            tls=tls,
            timeout=timeout,
            write_timeout=timeout,
            env=False,
        )


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
    if os.environ.get(ENV_ADDRESS):
        return os.environ[ENV_ADDRESS]
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
    token = args.token or os.environ.get(ENV_TOKEN) or None
    if token is None and local and stack.get("write_tokens_file"):
        token = Path(stack["write_tokens_file"]).read_text(encoding="utf-8").split()[0]
    local_tls = stack.get("client_tls") or {} if local else {}
    try:
        tls = ClientTLS.from_paths(
            args.tls_ca or os.environ.get(ENV_TLS_CA) or local_tls.get("ca"),
            args.tls_client_cert or os.environ.get(ENV_TLS_CLIENT_CERT) or local_tls.get("cert"),
            args.tls_client_key or os.environ.get(ENV_TLS_CLIENT_KEY) or local_tls.get("key"),
        )
        if tls is not None:
            tls.check()
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return Gateway(address, token, tls)


def _target(address: str | Gateway) -> Gateway:
    return address if isinstance(address, Gateway) else Gateway(address)


def _batches(docs: Iterator[Any], size: int) -> Iterator[list[Any]]:
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


def ingest_file(
    address: str | Gateway,
    path: str,
    batch: int = 64,
    parallel: int = 2,
    limit: int | None = None,
    timeout: float = 120.0,
    progress: bool = True,
) -> int:
    """Upsert the corpus at ``path`` (``parallel`` upserts of ``batch`` documents in
    flight, each retried by the SDK's policy); returns the number of documents upserted."""
    from tqdm import tqdm

    from services.corpus.readers import count_lines, read_corpus

    total = count_lines(path) if limit is None else limit
    docs = (
        gtr_client.Document(id=d.id, title=d.title, text=d.text, metadata=d.metadata)
        for d in length_sorted(read_corpus(path, limit=limit))
    )
    done = 0
    with (
        _target(address).client(timeout) as client,
        ThreadPoolExecutor(max_workers=max(1, parallel)) as pool,
        tqdm(total=total, unit="doc", desc="ingest", disable=not progress) as bar,
    ):
        pending: list[Future[gtr_client.UpsertResult]] = []
        sizes: list[int] = []
        for chunk in _batches(docs, max(1, min(batch, 256))):
            pending.append(pool.submit(client.upsert, chunk))
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


def parse_filter(items: Sequence[str]) -> dict[str, list[str]]:
    """``--filter KEY=V1,V2`` flags as the SDK's filter (every key must match)."""
    must: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise SystemExit(f"--filter {item!r}: expected KEY=VALUE[,VALUE...]")
        must.setdefault(key, []).extend(values.split(","))
    return must


def search_once(
    address: str | Gateway, query: str, k: int = 5, timeout: float = 10.0, **options: Any
) -> gtr_client.SearchResult:
    with _target(address).client(timeout) as client:
        return client.search_query(search_query(query, k, **options))


def search_query(query: str, k: int = 5, **options: Any) -> gtr_client.Query:
    """The SDK query of the ``search`` command's options (consistency, filters, rerank,
    depth, mode, fusion, rrf_k, dense_weight, candidates; None or absent: the gateway's
    default)."""
    fusion = None
    fused = ("fusion", "rrf_k", "dense_weight", "candidates")
    if any(options.get(name) is not None for name in fused):
        fusion = gtr_client.Fusion(
            method=gtr_client.FusionMethod(options["fusion"]) if options.get("fusion") else None,
            rrf_k=options.get("rrf_k") or 0,
            dense_weight=options.get("dense_weight"),
            candidates=options.get("candidates") or 0,
        )
    return gtr_client.Query(
        query,
        k=k,
        consistency=gtr_client.Consistency(options.get("consistency", "eventual")),
        filter=parse_filter(options.get("filters", [])) or None,
        rerank=bool(options.get("rerank")),
        rerank_depth=int(options.get("depth", 0)),
        mode=gtr_client.Mode(options["mode"]) if options.get("mode") else None,
        fusion=fusion,
    )


def format_hits(query: str, result: gtr_client.SearchResult, width: int | None = None) -> str:
    """A search's answer as the CLI prints it: a header (hits, time per stage, the first
    stage and fusion that answered, the model, the generation; a partial answer or a
    skipped rerank said), then one line per hit."""
    width = width or max(80, min(140, shutil.get_terminal_size((100, 20)).columns))
    t = result.timings
    fusion = result.fusion
    head = (
        f'"{query}"  ({len(result.hits)} hits, {t.total_ms:.0f} ms: encode '
        f"{t.encode_ms:.0f}, search {t.search_ms:.0f}, fetch {t.fetch_ms:.0f}"
        + (f", rerank {t.rerank_ms:.0f}" if result.reranked else "")
        + (f"; {result.mode.value}" if result.mode else "")
        + (
            f" ({fusion.method.value if fusion.method else 'unspecified'})"
            if fusion is not None
            else ""
        )
        + (f"; model {result.model}" if result.model else "; query not encoded")
        + (f", generation {result.generation}" if result.generation else "")
        + ("; query embedding from the cache" if result.embedding_cached else "")
        + ")"
    )
    if result.partial and result.missing_shards:
        head += f"  PARTIAL: shards {list(result.missing_shards)} missing"
    if result.sparse_missing_shards:
        head += f"  PARTIAL: shards {list(result.sparse_missing_shards)} answered dense only"
    if result.rerank_skipped_reason is not None:
        head += f"  NOT RERANKED: {result.rerank_skipped_reason}"
    lines = [head]
    title_w = min(40, max((len(h.title or h.id) for h in result.hits), default=10))
    snippet_w = max(20, width - title_w - 16)
    lines.append(f"{'#':>2}  {'score':>6}  {'title':<{title_w}}  text")
    for rank, hit in enumerate(result.hits, 1):
        title = (hit.title or hit.id)[:title_w]
        snippet = " ".join(hit.text.split())
        snippet = textwrap.shorten(snippet, snippet_w, placeholder=" …") if snippet else ""
        lines.append(f"{rank:>2}  {hit.score:6.3f}  {title:<{title_w}}  {snippet}")
    return "\n".join(lines)
