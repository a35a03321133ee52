"""Profiles: the GTR paper's figures and the mapping from a checkpoint to a profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.errors import NotFound
from services.encoder.model import default_model_dir
from services.encoder.profiles import (
    PROFILES,
    get_profile,
    profile_for_model_dir,
    t5_encoder_params_millions,
)


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


# The encoder part of the published gtr-t5-* config.json files.
_GTR_CONFIGS = {
    "base": {"d_model": 768, "d_ff": 3072, "d_kv": 64, "num_heads": 12, "num_layers": 12},
    "large": {"d_model": 1024, "d_ff": 4096, "d_kv": 64, "num_heads": 16, "num_layers": 24},
    "xl": {"d_model": 1024, "d_ff": 16384, "d_kv": 128, "num_heads": 32, "num_layers": 24},
    "xxl": {"d_model": 1024, "d_ff": 65536, "d_kv": 128, "num_heads": 128, "num_layers": 24},
}


@pytest.mark.parametrize("expected", sorted(_GTR_CONFIGS))
def test_gtr_config_selects_its_size(tmp_path: Path, expected: str) -> None:
    config = {
        "model_type": "t5",
        "vocab_size": 32128,
        "feed_forward_proj": "relu",
        **_GTR_CONFIGS[expected],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert profile_for_model_dir(tmp_path).name == expected


@pytest.mark.parametrize("expected", sorted(_GTR_CONFIGS))
def test_parameter_estimate_matches_the_profile(expected: str) -> None:
    config = {"vocab_size": 32128, "feed_forward_proj": "relu", **_GTR_CONFIGS[expected]}
    estimate = t5_encoder_params_millions(config)  # type: ignore[arg-type]
    assert estimate == pytest.approx(get_profile(expected).params_millions, rel=0.05)


@pytest.mark.parametrize("expected", ["large", "xl", "xxl"])
def test_unknown_t5_shape_maps_by_size(tmp_path: Path, expected: str) -> None:
    # the published shape with one more layer: no exact match, the nearest size by parameters
    shape = dict(_GTR_CONFIGS[expected], num_layers=25)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", **shape}))
    assert profile_for_model_dir(tmp_path).name == expected


def test_tiny_t5_maps_to_base(tmp_path: Path) -> None:
    config = {"model_type": "t5", "d_model": 48, "d_ff": 96, "num_heads": 4, "num_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert profile_for_model_dir(tmp_path).name == "base"


def test_bundled_minilm_maps_to_minilm_and_dim_overrides() -> None:
    assert profile_for_model_dir(default_model_dir()).name == "minilm"
    assert profile_for_model_dir(default_model_dir(), dim=48).dim == 48


def test_preferred_batch_sizes_stay_within_max_batch() -> None:
    for profile in PROFILES.values():
        sizes = profile.preferred_batch_sizes
        assert sizes and max(sizes) <= profile.max_batch
