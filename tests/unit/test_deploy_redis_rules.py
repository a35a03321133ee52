"""The Redis alerts (deploy/prometheus/redis_rules.yml): valid, unit-tested by promtool with
every alert shown both firing and not firing, and carried by the chart's PrometheusRule
when the Redis exporter runs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.chart import chart, component, of_kind, render

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "redis_rules.yml"
TESTS = PROMETHEUS / "redis_rules_test.yml"
__all__ = ["chart"]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed (scripts/bootstrap.sh installs prometheus)")
    return subprocess.run(
        [path, *args], cwd=PROMETHEUS, capture_output=True, text=True, check=False, timeout=60
    )


def alerts() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["alert"] for g in groups for r in g["rules"] if "alert" in r]


def test_rules_are_valid() -> None:
    done = promtool("check", "rules", RULES.name)
    assert done.returncode == 0, done.stdout + done.stderr


def test_rules_unit_tests_pass() -> None:
    done = promtool("test", "rules", TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_shown_firing_and_not_firing() -> None:
    shown: dict[str, set[bool]] = {}
    for case in yaml.safe_load(TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            shown.setdefault(check["alertname"], set()).add(bool(check["exp_alerts"]))
    assert alerts() and {a: shown.get(a, set()) for a in alerts()} == {
        a: {True, False} for a in alerts()
    }


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """promtool's test is live: the same tests against a rule that never fires fail."""
    broken = RULES.read_text().replace("expr: redis_up == 0", "expr: redis_up == 2")
    (PROMETHEUS / ".broken_redis_rules.yml").write_text(broken)
    tests = TESTS.read_text().replace("- redis_rules.yml", "- .broken_redis_rules.yml")
    (PROMETHEUS / ".broken_redis_rules_test.yml").write_text(tests)
    try:
        done = promtool("test", "rules", ".broken_redis_rules_test.yml")
    finally:
        (PROMETHEUS / ".broken_redis_rules.yml").unlink()
        (PROMETHEUS / ".broken_redis_rules_test.yml").unlink()
    assert done.returncode != 0 and "GtrRedisDown" in done.stdout + done.stderr


def test_the_chart_carries_them_with_the_exporter(chart: Any) -> None:
    monitoring = {"metrics": {"prometheusRule": {"enabled": True}}}
    (without,) = of_kind(render(chart, monitoring), "PrometheusRule")
    assert "gtr-redis" not in [g["name"] for g in without["spec"]["groups"]]
    docs = render(chart, {**monitoring, "redis": {"exporter": {"enabled": True}}})
    (rule,) = of_kind(docs, "PrometheusRule")
    groups = {g["name"]: g for g in rule["spec"]["groups"]}
    assert groups["gtr-redis"] == yaml.safe_load(RULES.read_text())["groups"][0]
    assert len(groups) == len(without["spec"]["groups"]) + 1
    # the ServiceMonitor's job label is the component: up{job="redis"} is the exporter
    assert [component(d) for d in of_kind(docs, "StatefulSet") if component(d) == "redis"]
