"""Errors of the two Python-backend models in a real tritonserver, and their meaning; and
the plan the GPU flavour's tokenizer reports on Triton's metrics endpoint.

One server hosts ``embed`` (CPU flavour, a queue of 1) and ``tokenizer`` (the GPU
flavour's first step, which runs on a CPU), each with the shared ``model_errors.py``
copied next to it by the repository writer.

Triton's core refuses a request without a *required* input before any model runs, so
the repository of this test declares the inputs optional: only then does a request
without KIND reach the model, which must answer INVALID_ARGUMENT (the
tokenizer used to fail on ``None`` with an AttributeError, reported as INTERNAL).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from services.common.errors import InvalidArgument, NotFound, Overloaded
from services.encoder.build.plan_meta import PlanMeta, write_plan
from services.encoder.build.repository import RepositoryConfig, generate_repository, read_config
from services.encoder.build.tensorrt_build import TENSORRT_VERSION
from services.encoder.model import default_model_dir
from services.encoder.runtime.triton_client import (
    TritonEncoder,
    TritonEncoderConfig,
    map_triton_error,
)
from services.encoder.serve.triton_server import TritonHandle, TritonServerConfig, run_triton
from tests.encoder_fixtures import encoder_base, ensure_onnx
from tests.support.processes import free_port


def _inputs_optional(model_dir: Path, cpu: bool = False) -> None:
    config = read_config(model_dir / "config.pbtxt")
    for tensor in config.input:
        tensor.optional = True
    if cpu:  # the GPU flavour's tokenizer runs on CPU instances; one is enough here
        del config.instance_group[:]
        config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonHandle]:
    base = encoder_base(tmp_path_factory)
    onnx_path = ensure_onnx(default_model_dir(), base)
    root = tmp_path_factory.mktemp("triton-errors")
    repo = root / "repo"
    generate_repository(
        onnx_path, repo, RepositoryConfig(instances=1, intra_op_threads=1, max_queue_size=1)
    )
    # The GPU repository around a stand-in FP32 plan (what `--precision auto` writes when
    # the FP16 build fails the gate): the tokenizer exports it (gtr_encoder_plan_info).
    plan = root / "plan" / "model.plan"
    write_plan(
        plan,
        b"stand-in engine",
        PlanMeta(
            TENSORRT_VERSION, "fp32", (1, 1), (8, 128), (64, 256), 0.9999, 40, "NVIDIA L4", "8.9"
        ),
    )
    generate_repository(onnx_path, root / "gpu", RepositoryConfig(flavor="gpu", plan_path=plan))
    shutil.copytree(root / "gpu" / "tokenizer", repo / "tokenizer")
    _inputs_optional(repo / "embed")
    _inputs_optional(repo / "tokenizer", cpu=True)
    for model in ("embed", "tokenizer"):
        assert (repo / model / "1" / "model_errors.py").exists(), model
    server = TritonServerConfig(
        repo,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        ready_model="tokenizer",
        startup_timeout_s=180,
    )
    with run_triton(server, root / "triton.log") as handle:
        yield handle


def _bytes_input(name: str, rows: list[bytes], two_d: bool) -> object:
    import tritonclient.grpc as grpcclient

    shape = [len(rows), 1] if two_d else [len(rows)]
    tensor = grpcclient.InferInput(name, shape, "BYTES")
    tensor.set_data_from_numpy(np.array(rows, dtype=object).reshape(shape))
    return tensor


# model → (the inputs sent: all but one, the missing one, a complete request)
REQUESTS = {
    "embed": ({"TEXT": [b"hello"]}, "KIND", {"TEXT": [b"hello"], "KIND": [b"query"]}),
    "tokenizer": ({"TEXT": [b"hello"]}, "KIND", {"TEXT": [b"hello"], "KIND": [b"query"]}),
}


@pytest.mark.parametrize("model", list(REQUESTS))
def test_a_missing_input_is_invalid_argument_in_every_model(
    triton: TritonHandle, model: str
) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    partial, missing, complete = REQUESTS[model]
    two_d = True  # embed and tokenizer batch: [rows, 1]
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, [_bytes_input(n, v, two_d) for n, v in partial.items()])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
        assert f"input {missing} is missing" in str(info.value.message())
        assert isinstance(map_triton_error(info.value, model), InvalidArgument)
        # the instance survived: a complete request is answered
        client.infer(model, [_bytes_input(n, v, two_d) for n, v in complete.items()])
    finally:
        client.close()


def test_an_unknown_model_is_not_found(triton: TritonHandle) -> None:
    async def go() -> None:
        with pytest.raises(NotFound, match="no-such-model"):
            await TritonEncoder.connect(TritonEncoderConfig(triton.grpc_url, model="no-such-model"))

    asyncio.run(go())


@pytest.mark.slow
def test_a_full_triton_queue_is_overloaded_not_unavailable(triton: TritonHandle) -> None:
    """Triton says UNAVAILABLE "Exceeds maximum queue size"; our word is Overloaded.

    The queue holds 1 request and the one instance is busy with a batch of 64 long
    documents, so of 8 such requests sent at once most are refused (no retries here:
    they would only hide the refusals)."""
    docs = [" ".join(f"w{i}{j}" for i in range(300)) for j in range(64)]

    async def go() -> None:
        cfg = TritonEncoderConfig(triton.grpc_url, retries=0)
        encoder = await TritonEncoder.connect(cfg)
        try:
            results = await asyncio.gather(
                *[encoder.encode(docs, "document", timeout=60) for _ in range(8)],
                return_exceptions=True,
            )
        finally:
            await encoder.close()
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors, "nothing was refused: the queue never filled"
        assert all(isinstance(e, Overloaded) for e in errors), errors
        assert "Exceeds maximum queue size" in str(errors[0])
        assert len(errors) < len(results), "the requests the queue took were answered"

    asyncio.run(go())


def test_the_error_status_is_grpc_s_code(triton: TritonHandle) -> None:
    """What tritonclient reports is the gRPC code's name (what code_of_name parses)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.get_model_config("no-such-model")
    finally:
        client.close()
    assert info.value.status() == str(grpc.StatusCode.NOT_FOUND)


def test_the_tokenizer_exports_the_plans_precision(triton: TritonHandle) -> None:
    """Issue #25 item 10: an FP32 plan (``--precision auto`` fell back) is not silent:
    Triton's metrics endpoint says which plan the encoder serves, and the log warns."""
    import urllib.request

    url = f"http://{triton.config.host}:{triton.config.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("gtr_encoder_plan_info{")]
    assert len(lines) == 1, text[-2000:]
    (line,) = lines
    assert 'precision="fp32"' in line and f'tensorrt_version="{TENSORRT_VERSION}"' in line
    assert 'gpu="NVIDIA L4"' in line and line.endswith(" 1")
    assert "the encoder serves a fp32 TensorRT plan" in triton.log_path.read_text()
