"""`gtr-retrieval index ...` and the shard settings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from services.cli.main import main
from services.index.server.settings import ShardSettings
from services.rpc.settings import SettingsError, load_settings


def test_index_train_from_embeddings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = np.random.default_rng(0).standard_normal((2000, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "index"
    argv = ["index", "train", "--embeddings", str(tmp_path / "x.npy"), "--out", str(out)]
    assert main([*argv, "--nlist", "8", "--pq-m", "4", "--model", "m"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["factory"] == "IVF8,PQ4x8,Refine(SQ8)" and manifest["model"] == "m"
    assert json.loads(capsys.readouterr().out)["nlist"] == 8


def test_index_train_target_recall_and_nprobe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.random.default_rng(0).standard_normal((2000, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    argv = ["index", "train", "--embeddings", str(tmp_path / "x.npy"), "--nlist", "32"]

    def train(out: str, *extra: str) -> dict[str, object]:
        assert main([*argv, "--out", str(tmp_path / out), *extra]) == 0
        capsys.readouterr()
        manifest: dict[str, object] = json.loads((tmp_path / out / "manifest.json").read_text())
        return manifest

    low = train("low", "--target-recall", "0.8")
    recalls = {int(p): r for p, r in low["recall_by_nprobe"].items()}  # type: ignore[attr-defined]
    nprobe = low["nprobe"]
    assert isinstance(nprobe, int) and low["target_recall"] == 0.8
    wide = {int(p): r for p, r in low["wide_recall_by_nprobe"].items()}  # type: ignore[attr-defined]
    # The smallest nprobe at which both the 10-recall@10 and the wide recall reach the target.
    assert low["measured_recall"] == recalls[nprobe] >= 0.8
    assert low["measured_wide_recall"] == wide[nprobe] >= 0.8
    assert min(recalls[nprobe - 1], wide[nprobe - 1]) < 0.8
    default = train("default")
    assert default["target_recall"] == 0.99 and default["nprobe"] > nprobe  # type: ignore[operator]
    fixed = train("fixed", "--nprobe", "5")
    assert fixed["nprobe"] == 5 and fixed["target_recall"] is None
    assert fixed["recall_by_nprobe"] == {"5": fixed["measured_recall"]}
    with pytest.raises(SystemExit):
        main([*argv, "--out", str(tmp_path / "bad"), "--target-recall", "1.5"])
    assert "1.5 is not in (0, 1]" in capsys.readouterr().err


def test_shard_settings_from_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GTR_SHARD_INDEX_DIR", "/idx")
    s = load_settings(
        ShardSettings, ["--shard", "1", "--shards", "2", "--snapshot-dir", "/s", "--port", "0"]
    )
    assert (s.shard, s.shards, s.index_dir, s.port) == (1, 2, "/idx", 0)
    with pytest.raises(SettingsError, match="shard 2 does not exist"):
        load_settings(ShardSettings, ["--shard", "2", "--shards", "2", "--snapshot-dir", "/s"])
