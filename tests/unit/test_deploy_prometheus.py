"""Prometheus rules and config in deploy/prometheus, checked and unit-tested by promtool."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
CHART_RULES = PROMETHEUS_DIR.parents[0] / "k8s" / "gtr-retrieval" / "files" / "rules.yml"

# Encoder size -> (encode SLO, search SLO) in seconds; the encode one is the GTR paper's.
SLO_SECONDS = {
    "base": (0.017, 0.05),
    "large": (0.034, 0.075),
    "xl": (0.096, 0.15),
    "xxl": (0.349, 0.5),
}
# services/common/metrics.py: a threshold that is not a bucket bound could never match.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.017, 0.025, 0.034, 0.05, 0.075, 0.096, 0.1,
    0.15, 0.25, 0.349, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed (scripts/bootstrap.sh installs prometheus)")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_check_rules() -> None:
    done = run_promtool("check", "rules", "rules.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_rule_unit_tests() -> None:
    done = run_promtool("test", "rules", "rules_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_rule_unit_tests_catch_a_wrong_threshold(tmp_path: Path) -> None:
    """rules_test.yml can fail: with xl's search threshold set to base's, it does."""
    rules = (PROMETHEUS_DIR / "rules.yml").read_text(encoding="utf-8")
    broken = rules.replace('{size: xl, le: "0.15"}', '{size: xl, le: "0.05"}')
    assert broken != rules
    (tmp_path / "rules.yml").write_text(broken, encoding="utf-8")
    shutil.copy(PROMETHEUS_DIR / "rules_test.yml", tmp_path / "rules_test.yml")
    done = subprocess.run(
        [promtool(), "test", "rules", "rules_test.yml"],
        cwd=tmp_path, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "GtrSearchLatencySLOFastBurn" in done.stdout + done.stderr


def test_check_config() -> None:
    done = run_promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    assert config["rule_files"] == ["rules.yml"]
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["targets.json"]


def test_slo_thresholds_match_the_paper_and_the_buckets() -> None:
    groups = yaml.safe_load((PROMETHEUS_DIR / "rules.yml").read_text(encoding="utf-8"))["groups"]
    rules = [r for g in groups for r in g["rules"]]
    for name, index in (
        ("gtr:encode_slo_threshold_seconds", 0),
        ("gtr:search_slo_threshold_seconds", 1),
    ):
        found = {
            r["labels"]["size"]: (
                float(r["expr"].removeprefix("vector(").rstrip(")")),
                r["labels"]["le"],
            )
            for r in rules
            if r.get("record") == name
        }
        assert set(found) == set(SLO_SECONDS), name
        for size, (seconds, le) in found.items():
            assert seconds == SLO_SECONDS[size][index], (name, size)
            assert float(le) == seconds and seconds in LATENCY_BUCKETS, (name, size)
            assert le == repr(seconds), "le must be spelled as prometheus_client spells it"


def test_chart_ships_the_same_rules() -> None:
    assert CHART_RULES.resolve() == (PROMETHEUS_DIR / "rules.yml").resolve()
