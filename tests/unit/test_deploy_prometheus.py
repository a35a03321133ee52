"""Prometheus rules and config in deploy/prometheus: generated from the SLO table, checked
and unit-tested by promtool, every alert shown firing and not firing."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client.utils import floatToGoString

from services.common import slo
from services.rpc.metrics import LATENCY_BUCKETS
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
CHART = ROOT / "deploy" / "k8s" / "gtr-retrieval"
CHART_RULES = CHART / "files" / "rules.yml"

# The GTR paper's encoder latencies (Ni et al. 2021, batch 1, 128 tokens), in ms: an
# outside source the table must agree with.
GTR_PAPER_MS = {"base": 17, "large": 34, "xl": 96, "xxl": 349}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed (scripts/bootstrap.sh installs prometheus)")
    return path


def run_promtool(*args: str, cwd: Path = PROMETHEUS_DIR) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=120
    )


def gen_rules() -> ModuleType:
    return load_script(ROOT / "scripts" / "gen_rules.py")


def load(name: str) -> Any:
    return yaml.safe_load((PROMETHEUS_DIR / name).read_text(encoding="utf-8"))


def rules_of(doc: Any) -> list[dict[str, Any]]:
    return [r for g in doc["groups"] for r in g["rules"]]


def test_rules_file_is_generated_from_the_slo_table() -> None:
    gen = gen_rules()
    assert (PROMETHEUS_DIR / "rules.yml").read_text(encoding="utf-8") == gen.render(), (
        "deploy/prometheus/rules.yml is stale: run python scripts/gen_rules.py"
    )
    assert gen.main(["--check"]) == 0


def test_check_rules() -> None:
    done = run_promtool("check", "rules", "rules.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@pytest.mark.slow
def test_rule_unit_tests() -> None:
    done = run_promtool("test", "rules", "rules_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_rule_unit_tests_catch_a_wrong_threshold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rules_test.yml can fail: with xl's search budget set to base's, it does."""
    gen = gen_rules()
    wrong = dataclasses.replace(slo.SLOS["xl"], search_s=slo.SLOS["base"].search_s)
    monkeypatch.setitem(slo.SLOS, "xl", wrong)
    (tmp_path / "rules.yml").write_text(gen.render(), encoding="utf-8")
    shutil.copy(PROMETHEUS_DIR / "rules_test.yml", tmp_path / "rules_test.yml")
    done = run_promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert done.returncode != 0
    assert "gtr:search_slo_error_ratio:rate5m" in done.stdout + done.stderr


def _static(labels: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in labels.items()}


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    """Each alert name has a promtool case where it fires and one where it does not; each
    rule of a name with several (burn-rate windows, one per job) is seen firing with its
    own labels."""
    alerts = [r for r in rules_of(load("rules.yml")) if "alert" in r]
    cases = [c for t in load("rules_test.yml")["tests"] for c in t.get("alert_rule_test", [])]
    firing: dict[str, list[dict[str, str]]] = {}
    quiet: set[str] = set()
    for case in cases:
        expected = case.get("exp_alerts") or []
        if not expected:
            quiet.add(case["alertname"])
        for alert in expected:
            firing.setdefault(case["alertname"], []).append(_static(alert["exp_labels"]))
    missing = []
    for rule in alerts:
        name, own = rule["alert"], _static(rule.get("labels", {}))
        if not any(own.items() <= seen.items() for seen in firing.get(name, [])):
            missing.append(f"{name} {own} never fires")
        if name not in quiet:
            missing.append(f"{name} is never shown not firing")
    assert not missing, "\n".join(sorted(set(missing)))
    names = {r["alert"] for r in alerts}
    assert set(firing) | quiet <= names, "rules_test.yml tests alerts rules.yml does not have"


def test_check_config() -> None:
    done = run_promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    config = load("prometheus.yml")
    assert config["rule_files"] == ["rules.yml"]
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["targets.json"]


def test_slo_thresholds_are_bucket_edges_and_the_papers_figures() -> None:
    for size, ms in GTR_PAPER_MS.items():
        assert slo.SLOS[size].encode_s * 1000 == pytest.approx(ms)
    for seconds in slo.thresholds():
        assert seconds in LATENCY_BUCKETS, f"{seconds} s is not a latency bucket edge"
    for s in slo.SLOS.values():
        assert s.encode_s < s.search_s < s.search_rerank_s, s


def test_rules_use_the_table_with_le_spelled_as_the_client_spells_it() -> None:
    rules = rules_of(load("rules.yml"))
    name = "gtr:encode_slo_threshold_seconds"
    encode = {r["labels"]["size"]: r for r in rules if r.get("record") == name}
    search = {
        (r["labels"]["size"], r["labels"]["rerank"]): r
        for r in rules
        if r.get("record") == "gtr:search_slo_threshold_seconds"
    }
    assert set(encode) == set(slo.SLOS)
    assert set(search) == {(s, f) for s in slo.SLOS for f in ("false", "true")}
    for size, table in slo.SLOS.items():
        assert encode[size]["labels"]["le"] == floatToGoString(table.encode_s)
        for flag in ("false", "true"):
            budget = table.search_budget_s(flag == "true")
            assert search[(size, flag)]["labels"]["le"] == floatToGoString(budget)
            assert search[(size, flag)]["expr"] == f"vector({budget!r})"


def test_chart_profiles_carry_the_tables_numbers() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    profiles = values["encoder"]["profiles"]
    assert set(profiles) == set(slo.SLOS)
    for size, table in slo.SLOS.items():
        p = profiles[size]
        got = (p["sloMs"], p["searchSloMs"], p["searchRerankSloMs"])
        want = (table.encode_s, table.search_s, table.search_rerank_s)
        assert got == pytest.approx(tuple(s * 1000 for s in want)), size


def test_chart_ships_the_same_rules() -> None:
    assert CHART_RULES.resolve() == (PROMETHEUS_DIR / "rules.yml").resolve()
