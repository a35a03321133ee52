"""Profiles: the GTR paper's figures and the mapping from a checkpoint to a profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.errors import NotFound
from services.encoder.model import default_model_dir
from services.encoder.profiles import PROFILES, get_profile, profile_for_model_dir


def test_gtr_sizes_carry_the_paper_slo_and_768_dims() -> None:
    slo = {name: PROFILES[name].slo_ms for name in ("base", "large", "xl", "xxl")}
    assert slo == {"base": 17.0, "large": 34.0, "xl": 96.0, "xxl": 349.0}
    for name in ("base", "large", "xl", "xxl"):
        profile = PROFILES[name]
        assert profile.dim == 768
        assert (profile.query_max_len, profile.document_max_len) == (64, 512)
        assert profile.family == "t5" and profile.triton_instances >= 1
        assert profile.max_len("query") == 64 and profile.max_len("document") == 512


def test_minilm_profile_says_where_its_slo_comes_from() -> None:
    minilm = get_profile("minilm")
    assert minilm.dim == 384
    assert (minilm.query_max_len, minilm.document_max_len) == (64, 256)
    assert minilm.slo_ms == PROFILES["base"].slo_ms and "GTR-base" in minilm.slo_source


def test_unknown_profile_lists_the_known_ones() -> None:
    with pytest.raises(NotFound, match="base"):
        get_profile("gigantic")


@pytest.mark.parametrize(("d_model", "expected"), [(768, "base"), (1024, "large"),
                                                   (2048, "xl"), (4096, "xxl")])  # fmt: skip
def test_t5_width_selects_the_gtr_size(tmp_path: Path, d_model: int, expected: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": d_model}))
    assert profile_for_model_dir(tmp_path).name == expected


def test_bundled_minilm_maps_to_minilm_and_dim_overrides() -> None:
    assert profile_for_model_dir(default_model_dir()).name == "minilm"
    assert profile_for_model_dir(default_model_dir(), dim=48).dim == 48


def test_preferred_batch_sizes_stay_within_max_batch() -> None:
    for profile in PROFILES.values():
        sizes = profile.preferred_batch_sizes
        assert sizes and max(sizes) <= profile.max_batch
