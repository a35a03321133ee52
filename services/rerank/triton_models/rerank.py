"""Triton Python-backend model ``rerank``: one query + its candidate texts → scores.

Copied as ``<repo>/rerank/1/model.py`` by ``services/rerank/triton_repository.py``, with
the models' shared ``model_errors.py`` (from ``services/encoder/triton_models``).
Unlike the encoder's model it imports the ``services`` package (the CELI scorer), so
the Python backend must run in an environment where gtr-retrieval is installed (the
launcher in ``services/encoder/triton_server.py`` runs the stub inside this venv).

Contract (config.pbtxt, no batching: one request = one query): ``QUERY`` BYTES [1],
``DOCS`` BYTES [-1] → ``SCORES`` FP32 [-1], in the order of ``DOCS``. An invalid
request (a missing input, empty query, no docs, > 1000 docs, bad UTF-8) gets an
INVALID_ARG error; the other requests are answered and the instance never dies.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_errors import BadRequest, error_response, input_column


def _texts(request: Any, name: str) -> list[str]:
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v)
            for v in input_column(request, name)]  # fmt: skip


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        from pathlib import Path

        import torch

        from services.rerank.checkpoint import load_or_default
        from services.rerank.scorer import CeliScorer

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        threads = int(params.get("threads", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        checkpoint = params.get("checkpoint") or None
        model, tokenizer, cfg = load_or_default(Path(checkpoint) if checkpoint else None)
        if args.get("model_instance_kind") == "GPU":
            model = model.to(f"cuda:{int(args.get('model_instance_device_id', 0))}")
        name = f"{cfg.variant}:{cfg.backbone}" + ("" if cfg.trained else ":untrained")
        batch = int(params.get("batch_size", "16") or 16)
        self.scorer = CeliScorer(model, tokenizer, cfg, name, batch)

    def _one(self, request: Any) -> Any:
        from services.common.errors import InvalidArgument
        from services.rerank.domain import Candidate, RerankQuery
        from services.rerank.scorer import validate

        try:
            query = _texts(request, "QUERY")
            docs = _texts(request, "DOCS")
            if len(query) != 1:
                raise InvalidArgument("QUERY must hold exactly one string")
            validate(RerankQuery(query[0], tuple(Candidate(str(i), d) for i, d in enumerate(docs))))
        except (BadRequest, InvalidArgument, UnicodeDecodeError) as exc:
            return error_response(getattr(exc, "message", None) or str(exc), invalid=True)
        try:
            scores = self.scorer.score(query[0], docs).astype(np.float32)
        except Exception as exc:  # never kill the instance: fail this request only
            return error_response(f"rerank failed: {exc}", invalid=False)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("SCORES", scores)])

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._one(request) for request in requests]

    def finalize(self) -> None:
        del self.scorer
