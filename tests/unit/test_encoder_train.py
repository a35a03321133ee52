"""`encoder train` on tiny models: the five architectures, the checkpoint layout, resume,
GradCache, the comparison and the refusals (nothing written on bad input)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.encoder.train.towers import ARCHS, build_towers, input_embeddings, tower_dirs
from services.encoder.train.trainer import TrainConfig, train
from tests.encoder_fixtures import (
    _corpus_lines,
    encoder_base,
    ensure_tiny_bert,
    ensure_tiny_t5,
    torch_embedder,
    write_beir,
)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_bert(encoder_base(tmp_path_factory))


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_t5(encoder_base(tmp_path_factory))


@pytest.fixture(scope="module")
def beir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_beir(tmp_path_factory.mktemp("beir"))


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GTR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gtr-cache"))


def config(beir: Path, base: Path, out: Path, arch: str, **kw: object) -> TrainConfig:
    cfg = TrainConfig(
        data_dir=beir,
        out=out,
        arch=arch,  # type: ignore[arg-type]
        base=base,
        batch_size=4,
        max_doc_len=32,
        eval_every=2,
        progress=False,
    )
    return replace(cfg, **kw)  # type: ignore[arg-type]


def test_sharing_of_each_architecture(bert_dir: Path, t5_dir: Path) -> None:
    sde = build_towers(bert_dir, "sde")
    assert sde.query is sde.document
    ade = build_towers(bert_dir, "ade")
    assert not {id(p) for p in ade.query.parameters()} & {id(p) for p in ade.document.parameters()}
    ste = build_towers(bert_dir, "ade-ste")
    emb = input_embeddings(ste.query)
    assert input_embeddings(ste.document) is emb and emb.weight.requires_grad
    assert ste.query.backbone is not ste.document.backbone
    fte = build_towers(bert_dir, "ade-fte")
    assert not input_embeddings(fte.query).weight.requires_grad
    assert not input_embeddings(fte.document).weight.requires_grad
    trainable = [p for p in fte.document.parameters() if p.requires_grad]
    assert len(trainable) == len(list(fte.document.parameters())) - 1
    for base in (bert_dir, t5_dir):  # BERT: a new identity projection; T5: GTR's Dense
        spl = build_towers(base, "ade-spl")
        assert spl.query.dense is spl.document.dense is not None
        assert spl.query.backbone is not spl.document.backbone
        assert spl.added_projection is (base == bert_dir)
    # SPL's added projection is the identity: untrained, it is the base model
    ids = torch.tensor([[101, 2054, 2003, 102]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.allclose(spl_bert(bert_dir)(ids, mask), sde.query(ids, mask), atol=1e-6)


def spl_bert(bert_dir: Path) -> torch.nn.Module:
    return build_towers(bert_dir, "ade-spl").query.eval()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow
def test_train_writes_loadable_towers_and_a_manifest(
    arch: str, beir: Path, bert_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / arch
    manifest = train(config(beir, bert_dir, out, arch)).manifest
    assert manifest["complete"] and manifest["arch"] == arch
    assert manifest["steps"] == manifest["total_steps"] == 5  # 19 train pairs / batch 4
    assert set(manifest["dev"]) >= {
        "ndcg_at_10",
        "recall_at_100",
        "mrr_at_10",
        "contrastive_entropy",
    }
    assert manifest["dev_split"]["dev_queries"] == 5 and len(manifest["dev_split"]["dev_qids"]) == 5
    assert manifest["data"]["digest"] and manifest["recipe"]["batch_size"] == 4
    assert [p["step"] for p in manifest["curve"]["dev"]] == [2, 4, 5]
    assert len(manifest["curve"]["loss"]) == 5 and (out / "training.png").stat().st_size > 0
    assert not (out / "trainer_state.pt").exists()
    dirs = tower_dirs(out)
    if arch == "sde":
        assert dirs["query"] == dirs["document"] == out and (out / "modules.json").exists()
    else:
        assert dirs == {"query": out / "query", "document": out / "document"}
    q = torch_embedder(dirs["query"]).embed(["read a json file"], "query")[0]
    d = torch_embedder(dirs["document"]).embed(["read a json file"], "query")[0]
    assert q.shape == (1, 32)
    if arch == "sde":
        return
    assert not np.allclose(q, d, atol=1e-4), "the towers were trained apart"
    if arch == "ade-spl":  # the shared projection saved in both, identical
        from safetensors.torch import load_file

        weights = [
            load_file(str(out / t / "2_Dense" / "model.safetensors"))["linear.weight"]
            for t in ("query", "document")
        ]
        assert torch.equal(weights[0], weights[1])
        assert not torch.equal(weights[0], torch.eye(32)), "the projection was trained"


@pytest.mark.slow
def test_resume_gives_the_uninterrupted_result(beir: Path, bert_dir: Path, tmp_path: Path) -> None:
    whole = train(config(beir, bert_dir, tmp_path / "whole", "ade-spl", final_eval=False))
    cut = config(beir, bert_dir, tmp_path / "cut", "ade-spl", final_eval=False)
    first = train(replace(cut, stop_after=2)).manifest
    assert not first["complete"] and (tmp_path / "cut" / "trainer_state.pt").exists()
    resumed = train(replace(cut, resume=True)).manifest
    assert resumed["curve"]["loss"] == pytest.approx(whole.manifest["curve"]["loss"], abs=1e-5)
    for tower in ("query", "document"):
        a = torch_embedder(tmp_path / "whole" / tower).embed(["json"], "query")[0]
        b = torch_embedder(tmp_path / "cut" / tower).embed(["json"], "query")[0]
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_micro_batches_give_the_full_batch_gradient(beir: Path, bert_dir: Path) -> None:
    from services.encoder.train.steps import in_batch_loss, step_loss
    from services.encoder.train.trainer import _codec

    cfg = config(beir, bert_dir, Path("unused"), "ade")
    codec = _codec(bert_dir, cfg)
    qs = ["read json", "temporary dir", "split a path", "run a process"]
    ds = [*_corpus_lines()[:4], *_corpus_lines()[10:14]]
    qids, dids = ["a", "b", "c", "d"], ["1", "2", "3", "4", "5", "6", "7", "8"]
    qrels = {q: {d: 1} for q, d in zip(qids, dids, strict=False)}

    def loss_fn(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return in_batch_loss(q, d, qids, dids, qrels, 0.05)

    grads = []
    for micro in (None, 1):
        towers = build_towers(bert_dir, "ade")
        towers.train(False)  # no dropout: both paths compute the same function
        step_loss(towers, codec, qs, ds, loss_fn, micro)
        # (BERT's pooler is not on the path: it gets no gradient either way)
        grads.append([p.grad.clone() for p in towers.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 20
    for full, chunked in zip(*grads, strict=True):
        torch.testing.assert_close(full, chunked, atol=1e-5, rtol=1e-4)


def test_a_second_positive_of_the_query_is_not_a_negative() -> None:
    from services.encoder.train.steps import in_batch_loss

    q = torch.eye(2)
    d = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])  # doc 2 = another positive of q0
    qrels = {"a": {"1": 1, "3": 1}, "b": {"2": 1}}
    masked = in_batch_loss(q, d, ["a", "b"], ["1", "2", "3"], qrels, 0.05)
    unmasked = in_batch_loss(q, d, ["a", "b"], ["1", "2", "3"], {"a": {"1": 1}, "b": {}}, 0.05)
    assert masked.item() < 1e-6 < unmasked.item()


@pytest.mark.slow
def test_compare_reports_every_variant_against_the_base(
    beir: Path, bert_dir: Path, tmp_path: Path
) -> None:
    from services.encoder.train.evaluate import compare, table

    outs = [tmp_path / a for a in ("sde", "ade-spl")]
    for out in outs:
        train(config(beir, bert_dir, out, out.name, eval_every=0))
    report = compare(beir, outs, plots=tmp_path / "plots", progress=False)
    assert set(report["variants"]) == {"sde", "ade_spl"}
    for row in [report["base"], *report["variants"].values()]:
        assert {
            "ndcg_at_10",
            "recall_at_100",
            "contrastive_entropy",
            "separability",
            "train_seconds",
        } <= set(row)
        assert 0.0 <= row["separability"] <= 1.0 and Path(row["projection_png"]).exists()
    sde = report["variants"]["sde"]
    assert sde["paired_low"] <= sde["ndcg_at_10_diff"] <= sde["paired_high"]
    assert (
        sde["ndcg_at_10"]
        == json.loads((outs[0] / "manifest.json").read_text())["dev"]["ndcg_at_10"]
    ), "eval and the trainer's own dev figure agree"
    assert set(report["pairs"]) == {"ade_spl - sde"}  # (no plain ADE trained here)
    assert "ade_spl" in table(report) and "nDCG@10 ade_spl - sde" in table(report)


def test_bad_input_is_refused_and_nothing_written(
    beir: Path, bert_dir: Path, t5_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    no_qrels = write_beir(tmp_path / "noqrels")
    (no_qrels / "qrels" / "train.tsv").unlink()
    with pytest.raises(NotFound, match=r"qrels/train\.tsv"):
        train(config(no_qrels, bert_dir, out, "sde"))
    unjudged = write_beir(tmp_path / "unjudged")
    (unjudged / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nzz\td0\t1\n")
    with pytest.raises(InvalidArgument, match=r"no query of queries\.jsonl has a judged document"):
        train(config(unjudged, bert_dir, out, "sde"))
    with pytest.raises(InvalidArgument, match=r"unknown arch 'ade-xyz'"):
        train(config(beir, bert_dir, out, "ade-xyz"))
    index = tmp_path / "index"
    index.mkdir()
    with pytest.raises(FailedPrecondition, match="needs a new index generation"):
        train(config(beir, t5_dir, out, "sde", index_dir=_index(index, 384)))
    assert not out.exists()


def _index(root: Path, dim: int) -> Path:
    """An index folder whose manifest says ``dim`` (as `index train` writes it)."""
    from services.index.core.train import Manifest

    Manifest(
        dim=dim,
        metric="ip",
        factory="IVF1,PQ4",
        model="m",
        nlist=1,
        pq_m=4,
        pq_bits=8,
        refine=False,
        refine_factor=1,
        nprobe=1,
        train_points=1,
        train_pq_error=0.0,
        train_seconds=0.0,
        created_at="now",
    ).write(root)
    return root


def test_a_two_tower_folder_is_not_taken_for_one_checkpoint(tmp_path: Path) -> None:
    from services.encoder.model import read_layout

    for tower in ("query", "document"):
        (tmp_path / tower).mkdir()
        (tmp_path / tower / "modules.json").write_text("[]")
    with pytest.raises(InvalidArgument, match=r"two-tower checkpoint \(query/ and document/\)"):
        read_layout(tmp_path)


def test_the_gpu_flavour_refuses_a_two_tower_export(tmp_path: Path) -> None:
    from services.encoder.build.export import EncoderMeta
    from services.encoder.build.repository import RepositoryConfig, generate_repository

    export = tmp_path / "export"
    export.mkdir()
    for name in ("model.onnx", "document.onnx", "tokenizer.json"):
        (export / name).write_bytes(b"")
    towers = {"query": "model.onnx", "document": "document.onnx"}
    EncoderMeta(
        "ade-spl", 32, "minilm", {"query": 64, "document": 256}, 0, "x", towers=towers
    ).write(export)
    kept = tmp_path / "repo" / "embed" / "config.pbtxt"  # a repository already there
    kept.parent.mkdir(parents=True)
    kept.write_text("name: 'embed'")
    with pytest.raises(FailedPrecondition, match="two-tower export"):
        generate_repository(export / "model.onnx", tmp_path / "repo", RepositoryConfig("gpu"))
    assert kept.read_text() == "name: 'embed'" and not (tmp_path / "repo" / "encoder").exists()


def test_the_command_names_the_missing_qrels_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli.main import main

    data = write_beir(tmp_path / "beir")
    (data / "qrels" / "train.tsv").unlink()
    out = tmp_path / "out"
    code = main(["encoder", "train", "--data", str(data), "--arch", "ade-spl", "--out", str(out)])
    assert code == 2 and "missing qrels/train.tsv" in capsys.readouterr().err
    assert not out.exists()
