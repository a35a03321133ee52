"""Triton Python-backend model ``tokenizer`` (GPU flavour, first step of the ``embed`` ensemble).

Copied as ``<repo>/tokenizer/1/model.py`` with ``textcodec.py``, ``model_errors.py``,
``tokenizer.json`` and ``encoder.json``. It turns ``TEXT``/``KIND`` (BYTES) into
``INPUT_IDS``/``ATTENTION_MASK`` (INT64, padded up to a length bucket so that the
TensorRT model's dynamic batcher can merge requests of similar length) and
``TRUNCATED`` (BOOL). Bad requests (a missing input included) get their own INVALID_ARG
response (``model_errors.py``); the ensemble passes it to the client.

It also exports what TensorRT plan the ``encoder`` step serves, on Triton's metrics
endpoint (a Python-backend custom metric): ``gtr_encoder_plan_info{precision,
tensorrt_version,gpu} 1``, from the parameters the repository writer copies out of the
plan's json. ``precision="fp32"`` means ``--precision auto`` fell back from FP16 (about
twice the latency and memory); it is also logged as a warning.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_errors import BadRequest, error_response, input_column, model_files
from textcodec import TextCodec, TextError, parse_rows


def _plan_info(params: dict[str, str]) -> tuple[Any, Any] | None:
    """``gtr_encoder_plan_info`` for the plan the repository was written around (kept
    referenced: Triton drops a metric family once it is collected)."""
    precision = params.get("plan_precision")
    if not precision:
        return None
    labels = {
        "precision": precision,
        "tensorrt_version": params.get("plan_tensorrt_version", ""),
        "gpu": params.get("plan_gpu", ""),
    }
    if precision != "fp16":
        pb_utils.Logger.log_warn(
            f"the encoder serves a {precision} TensorRT plan (the FP16 one failed the parity "
            "gate: see the build-plan log): about twice the latency and memory of FP16"
        )
    family = pb_utils.MetricFamily(
        name="gtr_encoder_plan_info",
        description="The TensorRT plan the encoder serves (1), by precision, TensorRT and GPU",
        kind=pb_utils.MetricFamily.GAUGE,
    )
    metric = family.Metric(labels=labels)
    metric.set(1)
    return family, metric


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        _config, params, here, meta = model_files(args)
        buckets = tuple(int(b) for b in params.get("seq_buckets", "").split(",") if b.strip())
        self.codec = TextCodec.from_file(
            os.path.join(here, "tokenizer.json"), meta["max_lens"], int(meta["pad_id"]), buckets
        )
        self.kinds = set(meta["max_lens"])
        self.plan_info = _plan_info(params)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                texts, kinds = parse_rows(
                    list(input_column(request, "TEXT")),
                    list(input_column(request, "KIND")),
                    self.kinds,
                )
                batch = self.codec.encode_mixed(texts, kinds)
            except (BadRequest, TextError) as exc:
                responses.append(error_response(str(exc), invalid=True))
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("INPUT_IDS", batch.input_ids),
                        pb_utils.Tensor("ATTENTION_MASK", batch.attention_mask),
                        pb_utils.Tensor(
                            "TRUNCATED", batch.truncated.reshape(-1, 1).astype(np.bool_)
                        ),
                    ]
                )
            )
        return responses
