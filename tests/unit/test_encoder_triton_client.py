"""Triton's errors go through the service's one map (services/rpc/status.py)."""

from __future__ import annotations

import grpc
import pytest
from tritonclient.utils import InferenceServerException

from services.common import errors
from services.encoder.runtime.triton_client import TRITON_QUEUE_FULL, map_triton_error
from services.rpc import status


@pytest.mark.parametrize("code", list(grpc.StatusCode), ids=lambda c: c.name)
def test_every_triton_status_code_maps_like_our_own_services(code: grpc.StatusCode) -> None:
    """The domain error of a Triton status is the one error_from_rpc gives the same code
    from a service of ours (the old string matching made FAILED_PRECONDITION Unavailable)."""
    exc = InferenceServerException("boom", status=str(code))  # tritonclient's format
    mapped = map_triton_error(exc, "embedding 1 texts")
    assert type(mapped) is status.ERROR_OF.get(code, errors.Unavailable)
    assert mapped.message == "embedding 1 texts: boom"


def test_a_full_queue_is_the_one_refinement() -> None:
    full = InferenceServerException(
        f"[request id: x] {TRITON_QUEUE_FULL}", status="StatusCode.UNAVAILABLE"
    )
    assert isinstance(map_triton_error(full, "x"), errors.Overloaded)
    restarting = InferenceServerException("failed to connect", status="StatusCode.UNAVAILABLE")
    assert type(map_triton_error(restarting, "x")) is errors.Unavailable


def test_an_error_without_a_status_is_unavailable() -> None:
    assert type(map_triton_error(InferenceServerException("?"), "x")) is errors.Unavailable
    assert type(map_triton_error(RuntimeError("socket closed"), "x")) is errors.Unavailable


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("StatusCode.NOT_FOUND", grpc.StatusCode.NOT_FOUND),
        ("INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT),
        (" StatusCode.DEADLINE_EXCEEDED ", grpc.StatusCode.DEADLINE_EXCEEDED),
        ("StatusCode.NOPE", grpc.StatusCode.UNKNOWN),
        ("", grpc.StatusCode.UNKNOWN),
        (None, grpc.StatusCode.UNKNOWN),
    ],
)
def test_code_of_name(name: str | None, code: grpc.StatusCode) -> None:
    assert status.code_of_name(name) is code
