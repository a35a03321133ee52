"""The committed int8 quality record holds one result per kernel behaviour: the same
graphs computed on CPUs whose integer kernels differ give other probe cosines, and each
machine takes the record its cosines reproduce (``services/encoder/build/int8_record``)."""

from __future__ import annotations

from pathlib import Path

from services.encoder.build import int8_record

MODEL = "all-MiniLM-L6-v2"
ON_A = [0.99, 0.98, 0.995]
ON_B = [0.994, 0.9843, 0.991]  # another CPU's kernels: off by up to 0.004


def _graphs(root: Path, tag: str) -> tuple[Path, Path]:
    root.mkdir(parents=True, exist_ok=True)
    fp32, int8 = root / "model.onnx", root / "query.int8.onnx"
    fp32.write_bytes(b"fp32 " + tag.encode())
    int8.write_bytes(b"int8 " + tag.encode())
    return fp32, int8


def _gates(cosines: list[float], ndcg: float) -> dict[str, object]:
    quality = {"passed": True, "drop": 0.002, "int8_ndcg_at_10": ndcg}
    return {"parity_cosines": cosines, "quality": quality}


def test_each_kernel_behaviour_finds_its_own_record(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    fp32, int8 = _graphs(tmp_path / "g", "one")
    int8_record.write_record(MODEL, fp32, int8, _gates(ON_A, 0.66), "a", path)
    int8_record.write_record(MODEL, fp32, int8, _gates(ON_B, 0.67), "b", path)
    assert len(int8_record.read_records(path)) == 2
    on_a, _ = int8_record.find_record(MODEL, fp32, int8, ON_A, path)
    on_b, _ = int8_record.find_record(MODEL, fp32, int8, ON_B, path)
    assert on_a is not None and on_a.quality["int8_ndcg_at_10"] == 0.66
    assert on_b is not None and on_b.quality["int8_ndcg_at_10"] == 0.67
    assert on_a.cpu == int8_record.cpu_name()
    elsewhere = [c - 0.01 for c in ON_A]
    record, why = int8_record.find_record(MODEL, fp32, int8, elsewhere, path)
    assert record is None
    assert "computes otherwise here" in why and "nearest of 2 record(s)" in why


def test_recording_again_replaces_only_the_same_kernels_and_drops_other_graphs(
    tmp_path: Path,
) -> None:
    path = tmp_path / "record.json"
    old_fp32, old_int8 = _graphs(tmp_path / "old", "old")
    int8_record.write_record(MODEL, old_fp32, old_int8, _gates(ON_A, 0.60), "old", path)
    fp32, int8 = _graphs(tmp_path / "new", "new")
    int8_record.write_record(MODEL, fp32, int8, _gates(ON_A, 0.65), "a", path)
    int8_record.write_record(MODEL, fp32, int8, _gates(ON_B, 0.67), "b", path)
    near_a = [c + 0.0005 for c in ON_A]  # the same kernels, measured again
    int8_record.write_record(MODEL, fp32, int8, _gates(near_a, 0.66), "a again", path)
    records = int8_record.read_records(path)
    assert sorted(r.command for r in records) == ["a again", "b"]
    record, why = int8_record.find_record(MODEL, old_fp32, old_int8, ON_A, path)
    assert record is None and "not the recorded ones" in why
