"""A two-tower (ADE-SPL) checkpoint through a real Triton: `KIND` picks the tower.

A tiny BERT in all-MiniLM-L6-v2's layout is trained as ADE-SPL for a few steps with a
large learning rate (so the towers differ clearly), exported (one ONNX per tower) and
served by the CPU repository under the one model name ``embed``; each tower's vectors
through Triton must match the in-process PyTorch tower within cosine 0.999, through
the unchanged client and in a request that mixes both kinds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from services.encoder.build.export import check_parity, export_onnx, row_cosines
from services.encoder.build.repository import RepositoryConfig, generate_repository, read_config
from services.encoder.runtime.onnx_embedder import OnnxEmbedder
from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig
from services.encoder.serve.triton_server import TritonHandle, TritonServerConfig, run_triton
from services.encoder.train.trainer import TrainConfig, train
from tests.encoder_fixtures import (
    SAMPLE_DOCUMENTS,
    SAMPLE_QUERIES,
    encoder_base,
    ensure_tiny_bert,
    torch_embedder,
    write_beir,
)
from tests.support.processes import free_port


@dataclass(frozen=True)
class Served:
    checkpoint: Path
    onnx: Path
    handle: TritonHandle


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch
) -> Iterator[Served]:
    base = encoder_base(tmp_path_factory)
    work = tmp_path_factory.mktemp("towers")
    monkeypatch_module.setenv("GTR_CACHE_DIR", str(work / "cache"))
    ckpt = work / "ade-spl"
    train(
        TrainConfig(
            data_dir=write_beir(work / "beir"),
            out=ckpt,
            arch="ade-spl",
            base=ensure_tiny_bert(base),
            batch_size=4,
            lr=5e-3,
            max_doc_len=32,
            eval_every=0,
            final_eval=False,
            progress=False,
        )
    )
    onnx = work / "export" / "model.onnx"
    export_onnx(ckpt, onnx)
    repo = work / "repo"
    generate_repository(onnx, repo, RepositoryConfig(instances=1, intra_op_threads=1))
    cfg = TritonServerConfig(
        repo,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        startup_timeout_s=90,
    )
    with run_triton(cfg, work / "triton.log") as handle:
        yield Served(ckpt, onnx, handle)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.slow
def test_export_has_one_graph_per_tower_and_both_pass_parity(served: Served) -> None:
    meta = json.loads((served.onnx.parent / "encoder.json").read_text())
    assert meta["towers"] == {"query": "model.onnx", "document": "document.onnx"}
    assert meta["model_name"] == "ade-spl"
    report = check_parity(served.checkpoint, served.onnx)
    assert report.passed and len(report.cosines) == 8  # 4 probe texts x 2 towers
    config = read_config(served.onnx.parent.parent / "repo" / "embed" / "config.pbtxt")
    assert config.name == "embed"
    assert config.parameters["document_onnx_file"].string_value == "document.onnx"


def test_the_towers_really_differ(served: Served) -> None:
    """Precondition of the next tests: serving the wrong tower would be caught."""
    q = torch_embedder(served.checkpoint / "query").embed(SAMPLE_DOCUMENTS, "document")[0]
    d = torch_embedder(served.checkpoint / "document").embed(SAMPLE_DOCUMENTS, "document")[0]
    assert max(row_cosines(q, d)) < 0.99


def test_each_kind_through_triton_matches_its_tower_in_process(served: Served) -> None:
    async def go() -> None:
        enc = await TritonEncoder.connect(TritonEncoderConfig(served.handle.grpc_url))
        try:
            assert (enc.model_name, enc.dim) == ("ade-spl", 32)
            for texts, kind in ((SAMPLE_QUERIES, "query"), (SAMPLE_DOCUMENTS, "document")):
                got = await enc.encode(texts, kind, timeout=10)  # type: ignore[arg-type]
                want = torch_embedder(served.checkpoint / kind).embed(texts, kind)[0]  # type: ignore[arg-type]
                assert min(row_cosines(got.vectors, want)) >= 0.999
        finally:
            await enc.close()

    asyncio.run(go())


def test_a_request_mixing_kinds_runs_each_row_through_its_tower(served: Served) -> None:
    import tritonclient.grpc as grpcclient

    texts = [SAMPLE_DOCUMENTS[0], SAMPLE_QUERIES[0], SAMPLE_DOCUMENTS[1], SAMPLE_QUERIES[1]]
    kinds = ["document", "query", "document", "query"]
    client = grpcclient.InferenceServerClient(served.handle.grpc_url)
    try:
        inputs = []
        for name, column in (("TEXT", texts), ("KIND", kinds)):
            tensor = grpcclient.InferInput(name, [len(column), 1], "BYTES")
            tensor.set_data_from_numpy(
                np.array([c.encode() for c in column], dtype=object).reshape(-1, 1)
            )
            inputs.append(tensor)
        got = np.asarray(client.infer("embed", inputs).as_numpy("EMBEDDING"))
    finally:
        client.close()
    for row, (text, kind) in enumerate(zip(texts, kinds, strict=True)):
        want = torch_embedder(served.checkpoint / kind).embed([text], kind)[0]  # type: ignore[arg-type]
        assert row_cosines(got[row : row + 1], want)[0] >= 0.999, (row, kind)
    # and the in-process ONNX path routes the same way
    onnx = OnnxEmbedder(served.onnx)
    for kind in ("query", "document"):
        want = torch_embedder(served.checkpoint / kind).embed(SAMPLE_DOCUMENTS, kind)[0]  # type: ignore[arg-type]
        assert min(row_cosines(onnx.embed(SAMPLE_DOCUMENTS, kind)[0], want)) >= 0.999  # type: ignore[arg-type]
