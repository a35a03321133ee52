"""CELI scores against a direct, loop-based computation of the formula on a tiny BERT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.rerank.checkpoint import CeliConfig, build_model
from services.rerank.model import (
    CeliModel,
    SpecialIds,
    init_for_training,
    maxsim,
    segment_masks,
    training_loss,
)
from services.rerank.serve.scorer import PairEncoder
from services.rerank.tiny import write_tiny_backbone

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_backbone(tmp_path_factory.mktemp("tiny") / "bert", WORDS, seed=3)


def _model(
    tiny_dir: Path, variant: str = "celi", d_tok: int = 8, max_len: int = 40, normalize: bool = True
):
    cfg = CeliConfig(
        variant=variant,  # type: ignore[arg-type]
        d_tok=d_tok,
        max_len=max_len,
        max_query_len=8,
        normalize=normalize,
    )
    model, tok = build_model(tiny_dir, cfg, seed=1)
    return model.eval(), PairEncoder(tok, cfg.max_query_len, cfg.max_len)


def _reference(model: CeliModel, ids: list[int], types: list[int]) -> tuple[float, float]:
    """s_m and s_l of ONE unpadded pair, written out with Python loops."""
    x = torch.tensor([ids])
    t = torch.tensor([types])
    hidden = model.backbone(input_ids=x, attention_mask=torch.ones_like(x), token_type_ids=t)[0][0]
    s_m = float(hidden[0] @ model.head.mono.weight[0] + model.head.mono.bias[0])
    if model.head.proj is None:
        return s_m, 0.0
    sep = model.special.sep
    first_sep = ids.index(sep)
    q_pos = list(range(1, first_sep))  # after [CLS], before the first [SEP]
    d_pos = list(range(first_sep + 1, len(ids) - 1))  # before the final [SEP]
    w, b = model.head.proj.weight, model.head.proj.bias
    vec = [hidden[p] @ w.T + b for p in range(len(ids))]
    if model.head.normalize:
        vec = [x / x.norm() for x in vec]
    s_l = 0.0
    for i in q_pos:
        if d_pos:
            s_l += max(float(vec[i] @ vec[j]) for j in d_pos)
    return s_m, s_l


QUERY = "alpha beta gamma"
DOCS = [
    "delta epsilon",
    "zeta eta theta iota kappa lambda mu nu xi " * 8,  # truncated to max_len
    "",  # empty document: s_l = 0
    "alpha [SEP] beta",  # a literal [SEP] is text, not a boundary
    "mu",
]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("d_tok", [8, 1])
def test_batched_scores_equal_loop_reference(tiny_dir: Path, d_tok: int, normalize: bool) -> None:
    model, pairs = _model(tiny_dir, d_tok=d_tok, normalize=normalize)
    ids, types = pairs.encode(QUERY, DOCS)
    assert len(ids[1]) == pairs.max_len  # the long document was truncated
    assert ids[1][-1] == model.special.sep
    batch = pairs.pad(ids, types)  # padded to the longest pair
    assert bool((batch.attention_mask == 0).any())
    with torch.inference_mode():
        out = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        for row in range(len(DOCS)):
            s_m, s_l = _reference(model, ids[row], types[row])
            assert out.s_m[row].item() == pytest.approx(s_m, abs=1e-4)
            assert out.s_l[row].item() == pytest.approx(s_l, abs=1e-4)
            assert out.score[row].item() == pytest.approx(s_m + s_l, abs=1e-4)
    assert out.s_l[2].item() == 0.0  # empty document


def test_query_truncated_to_max_query_len(tiny_dir: Path) -> None:
    model, pairs = _model(tiny_dir)
    long_query = " ".join(WORDS * 3)
    ids, _types = pairs.encode(long_query, ["alpha beta"])
    assert ids[0].index(model.special.sep) == 1 + pairs.max_query_len


def test_sep_positions_without_token_types_give_same_segments(tiny_dir: Path) -> None:
    model, pairs = _model(tiny_dir)
    ids, types = pairs.encode(QUERY, DOCS)
    batch = pairs.pad(ids, types)
    with_types = segment_masks(
        batch.input_ids, batch.attention_mask, model.special, batch.token_type_ids
    )
    from_seps = segment_masks(batch.input_ids, batch.attention_mask, model.special)
    assert torch.equal(with_types[0], from_seps[0]) and torch.equal(with_types[1], from_seps[1])


def test_late_term_ignores_special_and_padding_tokens() -> None:
    special = SpecialIds(cls=2, sep=3, pad=0)
    # [CLS] q q [SEP] d d [SEP] [PAD] [PAD]
    input_ids = torch.tensor([[2, 7, 8, 3, 9, 10, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0, 0]])
    q_mask, d_mask = segment_masks(input_ids, mask, special)
    assert q_mask.tolist() == [[False, True, True, False, False, False, False, False, False]]
    assert d_mask.tolist() == [[False, False, False, False, True, True, False, False, False]]
    v = torch.randn(1, 9, 4)
    base = maxsim(v, q_mask, d_mask)
    poisoned = v.clone()
    for pos in (0, 3, 6, 7, 8):  # [CLS], both [SEP]s, padding
        poisoned[0, pos] = 1e3
    assert torch.allclose(maxsim(poisoned, q_mask, d_mask), base)


def test_monobert_has_no_late_term_and_meanpool_differs(tiny_dir: Path) -> None:
    mono, pairs = _model(tiny_dir, variant="monobert")
    mean, _ = _model(tiny_dir, variant="meanpool")
    ids, types = pairs.encode(QUERY, DOCS)
    batch = pairs.pad(ids, types)
    with torch.inference_mode():
        m = mono(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        p = mean(batch.input_ids, batch.attention_mask, batch.token_type_ids)
    assert mono.head.proj is None and torch.equal(m.score, m.s_m) and not m.s_l.any()
    assert torch.allclose(p.score, p.s_m + p.s_l) and p.s_l.abs().sum() > 0


def test_loss_is_lce_on_both_terms(tiny_dir: Path) -> None:
    model, pairs = _model(tiny_dir)
    ids, types = pairs.encode(QUERY, DOCS[:4])
    batch = pairs.pad(ids, types)
    out = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
    ce = torch.nn.functional.cross_entropy
    want = ce(out.s_m.view(1, 4), torch.tensor([0])) + ce(out.s_l.view(1, 4), torch.tensor([0]))
    assert training_loss(out, 4, "celi").item() == pytest.approx(want.item(), rel=1e-6)
    training_loss(out, 4, "celi").backward()
    assert model.head.proj is not None and model.head.proj.weight.grad is not None


def test_training_init_starts_from_neutral_s_m_and_orthogonal_projection(tiny_dir: Path) -> None:
    model, pairs = _model(tiny_dir)
    init_for_training(model.head)
    assert model.head.proj is not None
    w = model.head.proj.weight  # (d_tok, hidden): orthonormal rows
    assert torch.allclose(w @ w.T, torch.eye(w.shape[0]), atol=1e-5)
    ids, types = pairs.encode(QUERY, DOCS)
    batch = pairs.pad(ids, types)
    with torch.inference_mode():
        out = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
    assert not out.s_m.any() and torch.equal(out.score, out.s_l)


def test_checkpoint_config_without_normalize_reads_as_unnormalised(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text('{"variant": "celi", "d_tok": 32}')
    assert CeliConfig.read(tmp_path / "c.json").normalize is False
    assert CeliConfig().normalize is True
