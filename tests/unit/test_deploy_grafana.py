"""The Grafana dashboard (deploy/grafana/gtr-retrieval.json) and the Prometheus rules
name only metrics that exist, in expressions that parse.

"Exist": the metric families the services register (read from real registries of the
gateway, a shard replica bound to a real trained shard, the reranker), the recording
rules of rules.yml, Prometheus's ``up``, and the few exporter metrics the rules rely on
(Triton's ``nv_inference_*``, redis_exporter's ``redis_*``; named below). "Parse":
promtool checks every panel expression as a rule of a throwaway rules file.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import yaml
from prometheus_client import CollectorRegistry

from services.common.slo import slo_for
from services.gateway.metrics import GatewayMetrics, GenerationMetrics, QueryCacheMetrics
from services.index.changelog import LogReader
from services.index.core.gpu import GpuMetrics
from services.index.core.shard import IvfPqShard
from services.index.core.train import TrainOptions, train_index
from services.index.core.trained import TrainedIndex
from services.index.server.metrics import ShardMetrics
from services.rerank.serve.metrics import RerankMetrics
from services.rpc.metrics import RpcMetrics
from tests.support.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "gtr-retrieval.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"

# Metrics of processes that are not ours: Triton's (docs: Triton Inference Server,
# "Metrics") and redis_exporter's (oliver006/redis_exporter).
EXTERNAL = {
    "up",
    "nv_inference_queue_duration_us",
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "redis_up",
    "redis_memory_used_bytes",
    "redis_memory_max_bytes",
}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or"}
_KEYWORDS |= {"unless", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric (and recording rule) names a PromQL expression selects."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range selectors
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"(?<![\w:])\d+(ms|s|m|h|d|w|y)\b", " ", s)  # durations (offset)
    s = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", " ", s)  # numbers
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[match.end() :].lstrip().startswith("(") or match.group(0).lower() in _KEYWORDS:
            continue  # a function or an operator
        names.add(match.group(0))
    return names


def test_metric_names_finds_the_metrics_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, stage) (rate(a_seconds_bucket{x="y(z)"}[5m])))'
        " / on (ns) group_left (size) b:rule:rate5m * 1e6 > bool 0.5 and c_total offset 5m"
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b:rule:rate5m", "c_total"}


def _names(registry: CollectorRegistry) -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
    return {
        family.name + suffix
        for family in registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every metric name our processes export, from their real registries."""
    gateway = CollectorRegistry()
    GatewayMetrics.create(gateway, "m", "base", slo_for("base"), rerank=True)
    QueryCacheMetrics.create(gateway)
    GenerationMetrics.create(gateway)
    RpcMetrics.create(gateway, "gateway")

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((1000, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index_dir = tmp_path_factory.mktemp("tiny-index")
    train_index(vectors, index_dir, TrainOptions(nlist=4, pq_m=4, nprobe=4, model="t"))
    shard = CollectorRegistry()
    metrics = ShardMetrics.create(shard, 0, "r0")
    metrics.bind(IvfPqShard(TrainedIndex.load(index_dir)))
    # The log gauges read Redis on scrape; with none there they read NaN, but exist.
    client = redis.Redis(port=free_port(), socket_connect_timeout=1)
    metrics.watch_log(LogReader(client, 0), lambda: "0-0")
    RpcMetrics.create(shard, "index")
    GpuMetrics.create(shard, 0, "r0")  # services/index/server/process.py, same registry

    rerank = CollectorRegistry()
    RerankMetrics.create(rerank)
    RpcMetrics.create(rerank, "rerank")
    return _names(gateway) | _names(shard) | _names(rerank)


def load_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [r for g in doc["groups"] for r in g["rules"]]


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the dashboard."""
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [
        (p["title"], t["expr"]) for p in board["panels"] if p["type"] != "row" for t in p["targets"]
    ]


def test_dashboard_layout() -> None:
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
    assert len(dashboard_targets()) >= 20


def _promtool_check(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (scripts/bootstrap.sh installs prometheus)")
    records = [{"record": f"dashboard:query:{i}", "expr": e} for i, e in enumerate(exprs)]
    rules = {"groups": [{"name": "dashboard", "rules": records}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules), encoding="utf-8")
    return subprocess.run(
        [promtool, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_every_panel_expression_parses(tmp_path: Path) -> None:
    exprs = [e for _, e in dashboard_targets()]
    done = _promtool_check(exprs, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # and the check can fail: a broken expression is reported
    assert _promtool_check([*exprs, "sum(rate(x[5m])"], tmp_path).returncode != 0


@pytest.mark.slow
def test_every_panel_names_metrics_that_exist(exported: set[str]) -> None:
    recorded = {r["record"] for r in load_rules() if "record" in r}
    known = exported | recorded | EXTERNAL
    unknown = {
        (title, name)
        for title, expr in dashboard_targets()
        for name in metric_names(expr)
        if name not in known
    }
    assert not unknown, sorted(unknown)


@pytest.mark.slow
def test_every_rule_names_metrics_that_exist(exported: set[str]) -> None:
    rules = load_rules()
    recorded = {r["record"] for r in rules if "record" in r}
    known = exported | recorded | EXTERNAL
    unknown = {
        (r.get("record") or r["alert"], name)
        for r in rules
        for name in metric_names(r["expr"])
        if name not in known
    }
    assert not unknown, sorted(unknown)


@pytest.mark.slow
def test_the_slis_metrics_are_exported(exported: set[str]) -> None:
    """The names the SLIs are built on, spelled out: a rename in the code fails here."""
    assert {
        "gtr_encode_seconds_bucket",
        "gtr_encode_calls_total",
        "gtr_search_seconds_bucket",
        "grpc_server_handled_total",
        "gtr_slo_seconds",
        "gateway_partial_results_total",
        "gateway_searches_total",
        "gateway_rerank_configured",
        "gateway_triton_configured",
        "index_log_lag_seconds",
        "index_log_newest_entry_timestamp_seconds",
        "index_log_applied_entry_timestamp_seconds",
    } <= exported
