"""Triton Python-backend model ``embed`` (CPU flavour): raw text in, embedding out.

Copied as ``<repo>/embed/1/model.py`` by ``services/encoder/build/repository.py`` together
with ``textcodec.py``, ``model_errors.py``, ``tokenizer.json``, ``encoder.json`` and
``model.onnx``. It imports numpy, onnxruntime and tokenizers only, never the service
package, so the repository can be shipped on its own.

Contract (see config.pbtxt): ``TEXT`` BYTES [1], ``KIND`` BYTES [1] ("query" or
"document") → ``EMBEDDING`` FP32 [dim] (L2-normalised), ``TRUNCATED`` BOOL [1].
All rows of all requests that the dynamic batcher hands over are run together. A
two-tower model (parameter ``document_onnx_file``, ``encoder train --arch ade*``) runs
each row through the graph of its kind: queries through ``onnx_file``, documents
through ``document_onnx_file``. An int8 tower (``encoder.json`` ``query_precision``
or ``document_precision``, ``encoder export --query-precision int8 [--document-precision
int8]``) runs one row per graph run, so that a row's vector never depends on the rows it
was batched with.
A bad request (empty text, invalid UTF-8, unknown kind) gets its own error response;
the other requests of the batch are answered, and the instance never dies.

``ENCODER`` BYTES [1] (optional output): this version's description as JSON (version,
source model, dim, profile, digest; from ``version.json``), one per row. A request that
asks for it alone is answered without running the graph: ``TritonEncoder.connect``
learns its pinned version's name and digest so, since they are no longer in the config.

The rows of a graph are tokenized together and run in pieces of about one length
(``textcodec.length_pieces``: at most ``PIECE_ROWS`` rows, padded by at most a tenth of
their tokens, on one ONNX thread at most ``ONE_THREAD_PIECE_TOKENS`` tokens), not in
arrival order: one long document padded a piece of short ones, and on a CPU a padded
token costs as much as a real one.

A request whose client has gone (``is_cancelled()``) is answered CANCELLED without being
run, and the check is repeated before each piece: when every request of the batch has
gone, the rest is not run. A batch of 64 long documents is seconds of work on a shared
2-core machine, and a stopping tritonserver waits for it before it can unload the model;
running it whole for nobody made a SIGTERMed server overrun ``--exit-timeout-secs`` and
exit 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_errors import (
    BadRequest,
    cancelled_response,
    error_response,
    input_column,
    model_files,
)
from textcodec import PIECE_ROWS, TextCodec, TextError, TokenBatch, parse_rows, run_in_pieces

# the file naming the CPUs a version's stub runs on (services.process.cpus budget_path:
# <repo>/.<model>.<version>.cpu-budget, beside the model folders, never in the version
# folder, whose change after the load would make Triton reload this version)
BUDGET_FILE = "cpu-budget"
# how often (s) a request looks whether the CPUs this stub may use changed
CPU_CHECK_S = 1.0
# the optional output describing this version, and the outputs that need the graph
ENCODER_OUTPUT = "ENCODER"
EMBED_OUTPUTS = ("EMBEDDING", "TRUNCATED")


class Cancelled(Exception):
    """Every request of the batch has been cancelled: the rest of it is not run."""


def _threads(config: dict[str, Any], requested: int) -> int:
    """0 means: share this machine's cores evenly among the model's instances."""
    if requested > 0:
        return requested
    instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
    return max(1, len(os.sched_getaffinity(0)) // instances)


def _pin_self(cpus: set[int]) -> None:
    """Every thread of this process to ``cpus`` (a thread created later inherits it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            continue


def parse_request(request: Any, kinds: set[str]) -> tuple[list[str], list[str]]:
    """(texts, kinds) of one request, or BadRequest/TextError naming the input or row."""
    return parse_rows(
        list(input_column(request, "TEXT")), list(input_column(request, "KIND")), kinds
    )


class TritonPythonModel:
    """Tokenize with ``textcodec`` and run ``model.onnx`` with ONNX Runtime."""

    def initialize(self, args: dict[str, str]) -> None:
        import onnxruntime as ort

        config, params, here, meta = model_files(args)
        self.codec = TextCodec.from_file(
            os.path.join(here, "tokenizer.json"), meta["max_lens"], int(meta["pad_id"])
        )
        self.kinds = set(meta["max_lens"])
        # an int8 tower runs one row per graph run (its activation scales span the batch:
        # a row's vector would depend on its companions; query_int8.py, document_int8.py)
        self.row_by_row = {
            kind
            for kind in ("query", "document")
            if meta.get(f"{kind}_precision", "fp32") == "int8"
        }
        self.piece_rows = min(PIECE_ROWS, max(1, int(config.get("max_batch_size", 0)) or 64))
        self._ort, self._config, self._params, self._here = ort, config, params, here
        described = ("source_model", "dim", "profile", "digest")
        self.description = json.dumps(
            {"version": int(args["model_version"]), **{k: params.get(k, "") for k in described}}
        )
        # A rollout's CPU budget (docs/generations.md): a version published for a rollout
        # with --cpus runs there until the stack widens it again at the end.
        version_dir = os.path.normpath(here)
        model_dir = os.path.dirname(version_dir)
        name = f".{os.path.basename(model_dir)}.{os.path.basename(version_dir)}.{BUDGET_FILE}"
        budget = os.path.join(os.path.dirname(model_dir), name)
        if os.path.exists(budget):
            with open(budget) as fh:
                _pin_self({int(c) for c in fh.read().split(",") if c.strip()})
        self._cpus = len(os.sched_getaffinity(0))
        self._checked = time.monotonic()
        self._reopening: threading.Thread | None = None
        self.session, self.sessions, self.threads = self._open()

    def _open(self) -> tuple[Any, dict[str, Any], dict[int, int]]:
        """(the main session, kind → session, session id → its ONNX Runtime threads, which
        size its pieces: ``TokenBatch.pieces``): one graph for every kind, or a tower per
        kind; threads as :func:`_threads` says for the CPUs allowed now."""
        ort, params = self._ort, self._params
        threads = _threads(self._config, int(params.get("intra_op_threads", "0")))

        def session(name: str, threads: int) -> Any:
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            # Busy-waiting worker threads take the cores that Triton's threads and this
            # stub need between batches: on a 2-core box that stalled requests for ~500 ms.
            spin = params.get("allow_spinning", "0")
            options.add_session_config_entry("session.intra_op.allow_spinning", spin)
            path = os.path.join(self._here, name)
            return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

        towers = bool(params.get("document_onnx_file"))
        # A query tower of its own that runs one query per graph run (int8) gains nothing
        # from a second thread (2.1 ms with one, 2.3-3.2 with two) and wakes it for every
        # op: 1.5-2x the CPU per query (docs/performance.md, "One hop fewer").
        alone = towers and "query" in self.row_by_row
        main_threads = 1 if alone else threads
        main = session(params.get("onnx_file", "model.onnx"), main_threads)
        sessions = {kind: main for kind in self.kinds}
        threads_of = {id(main): main_threads}
        if towers:
            sessions["document"] = session(params["document_onnx_file"], threads)
            threads_of[id(sessions["document"])] = threads
        return main, sessions, threads_of

    def _follow_cpus(self) -> None:
        """When this stub may use more CPUs than its sessions were opened for (a rollout's
        budget ended), reopen them with as many threads, in the background: requests keep
        the old sessions until the new ones are ready. Fewer CPUs (a budget began) reopen
        nothing: opening a session costs a second of CPU on the cores serving is left with,
        more than a thread too many costs. Looked at once a second at most."""
        now = time.monotonic()
        if now - self._checked < CPU_CHECK_S or int(self._params.get("intra_op_threads", "0")):
            return
        self._checked = now
        cpus = len(os.sched_getaffinity(0))
        if cpus <= self._cpus or (self._reopening is not None and self._reopening.is_alive()):
            return
        self._cpus = cpus

        def reopen() -> None:
            # keep serving with the sessions there are
            with contextlib.suppress(Exception):
                self.session, self.sessions, self.threads = self._open()

        self._reopening = threading.Thread(target=reopen, name="reopen-sessions", daemon=True)
        self._reopening.start()

    def _embed(
        self, texts: list[str], kinds: list[str], gone: Callable[[], bool]
    ) -> tuple[np.ndarray, np.ndarray]:
        groups: dict[int, list[int]] = {}  # rows per graph, in request order
        graphs = {id(s): s for s in self.sessions.values()}
        single = {id(self.sessions[kind]) for kind in self.row_by_row}
        threads = self.threads
        for row, kind in enumerate(kinds):
            groups.setdefault(id(self.sessions[kind]), []).append(row)
        vectors: np.ndarray | None = None
        truncated = np.zeros(len(texts), dtype=bool)
        for graph, rows in groups.items():
            session = graphs[graph]

            def run(part: TokenBatch) -> np.ndarray:
                if gone():  # looked at before every piece
                    raise Cancelled
                feeds = {"input_ids": part.input_ids, "attention_mask": part.attention_mask}
                return session.run(["embedding"], feeds)[0]  # noqa: B023 (run at once)

            batch = self.codec.encode_mixed([texts[i] for i in rows], [kinds[i] for i in rows])
            pieces = batch.pieces(
                threads.get(graph), max_rows=self.piece_rows, one_row=graph in single
            )
            out = run_in_pieces(batch, pieces, run)
            if vectors is None:
                vectors = np.zeros((len(texts), out.shape[1]), dtype=np.float32)
            vectors[rows] = out
            truncated[rows] = batch.truncated
        assert vectors is not None
        return vectors, truncated

    def execute(self, requests: list[Any]) -> list[Any]:
        self._follow_cpus()
        responses: list[Any] = [None] * len(requests)
        spans: list[tuple[int, int, int]] = []  # (request index, first row, row count)
        texts: list[str] = []
        kinds: list[str] = []
        described: set[int] = set()  # requests that asked for ENCODER
        for i, request in enumerate(requests):
            if request.is_cancelled():
                responses[i] = cancelled_response()
                continue
            try:
                req_texts, req_kinds = parse_request(request, self.kinds)
            except (BadRequest, TextError) as exc:
                responses[i] = error_response(str(exc), invalid=True)
                continue
            asked = set(request.requested_output_names())
            if ENCODER_OUTPUT in asked:
                described.add(i)
                if not asked & set(EMBED_OUTPUTS):  # the description alone: no graph run
                    responses[i] = pb_utils.InferenceResponse(
                        output_tensors=[self._describe(len(req_texts))]
                    )
                    continue
            spans.append((i, len(texts), len(req_texts)))
            texts.extend(req_texts)
            kinds.extend(req_kinds)
        if spans:

            def gone() -> bool:
                return all(requests[i].is_cancelled() for i, _, _ in spans)

            try:
                vectors, truncated = self._embed(texts, kinds, gone)
            except Cancelled:
                for i, _, _ in spans:
                    responses[i] = cancelled_response()
                return responses
            except Exception as exc:  # never kill the instance: fail these requests only
                for i, _, _ in spans:
                    responses[i] = error_response(f"embedding failed: {exc}", invalid=False)
                return responses
            for i, first, count in spans:
                tensors = [
                    pb_utils.Tensor("EMBEDDING", vectors[first : first + count]),
                    pb_utils.Tensor("TRUNCATED", truncated[first : first + count].reshape(-1, 1)),
                ]
                if i in described:
                    tensors.append(self._describe(count))
                responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
        return responses

    def _describe(self, rows: int) -> Any:
        """The ``ENCODER`` output: this version's description, once per row."""
        column = np.array([self.description.encode()] * rows, dtype=np.object_)
        return pb_utils.Tensor(ENCODER_OUTPUT, column.reshape(-1, 1))

    def finalize(self) -> None:
        self.session = None
        self.sessions = {}
