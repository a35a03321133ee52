"""Files, inputs and error answers of our Triton Python-backend models: one helper for both.

Copied next to each ``model.py`` (``embed``, ``tokenizer``) the way ``textcodec.py`` is,
by ``services/encoder/build/repository.py``; it imports numpy and Triton's
``triton_python_backend_utils`` only, so it runs in any stub.

The rule of every model: a bad request (a missing input, bad text) gets its own error
response with INVALID_ARG, which a client sees as gRPC INVALID_ARGUMENT and the gateway
as InvalidArgument (``services/rpc/status.py``); a failure of the model itself gets
INTERNAL. Neither fails the other requests of the batch nor kills the instance.

Triton's core already refuses a request that lacks a *required* input, before any model
runs; a model sees a missing input only when its config marks the input optional, and
:func:`input_column` then answers INVALID_ARG instead of failing on ``None``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils


def version_params(params: dict[str, str], version: str) -> dict[str, str]:
    """The model's parameters as version ``version`` sees them: the model-wide ones
    overlaid with its own ``version.<n>.<key>`` (one ``embed`` model serves several
    encoder versions, each with its own graph files; ``encoder publish`` writes them)."""
    prefix = f"version.{version}."
    shared = {k: v for k, v in params.items() if not k.startswith("version.")}
    return {**shared, **{k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}}


# A version folder's own description (``embed``: source model, dim, profile, digest, graph
# files), written by ``encoder repo`` / ``encoder publish``: per-version facts live there,
# not in config.pbtxt, whose change would make Triton reload every version.
VERSION_FILE = "version.json"


def model_files(args: dict[str, str]) -> tuple[dict[str, Any], dict[str, str], str, Any]:
    """(config, its string parameters as this version sees them, the version folder,
    ``encoder.json``) of the model version that Triton's ``initialize(args)`` describes:
    the shared parameters overlaid with an older repository's ``version.<n>.*`` ones and
    with the version folder's ``version.json``."""
    config = json.loads(args["model_config"])
    params = version_params(
        {k: v["string_value"] for k, v in config.get("parameters", {}).items()},
        str(args["model_version"]),
    )
    here = os.path.join(args["model_repository"], args["model_version"])
    own = os.path.join(here, VERSION_FILE)
    if os.path.exists(own):
        with open(own) as f:
            params.update({k: str(v) for k, v in json.load(f).items()})
    with open(os.path.join(here, "encoder.json")) as f:
        meta = json.load(f)
    return config, params, here, meta


class BadRequest(ValueError):
    """The request is wrong; the message says which input and why (→ INVALID_ARG)."""


def input_column(request: Any, name: str) -> np.ndarray:
    """Input ``name`` of ``request`` as one flat column; BadRequest when it is missing."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise BadRequest(f"input {name} is missing")
    return np.asarray(tensor.as_numpy()).reshape(-1)


def error_response(message: str, *, invalid: bool) -> Any:
    """An error answer: INVALID_ARG when the request is wrong, INTERNAL when the model is."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG" if invalid else "INTERNAL", None)
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def cancelled_response() -> Any:
    """The answer to a request whose client has gone (CANCELLED): it is not run."""
    code = getattr(pb_utils.TritonError, "CANCELLED", None)
    message = "cancelled: the client has gone"
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
