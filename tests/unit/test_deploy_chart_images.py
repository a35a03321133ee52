"""The chart runs the images scripts/build_images.sh builds (issue #15), its Triton and
Redis are production-shaped, and the schema refuses what it must.

Rendered offline like tests/unit/test_deploy_chart.py (helpers: tests/support/chart.py);
every manifest of the four install shapes the deploy README describes is validated
against the Kubernetes schemas (kubernetes-validate, strict).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.index.client.addresses import parse_shard_addresses
from tests.support.chart import (
    chart,
    component,
    configmap_data,
    helm,
    of_kind,
    render,
    render_as_given,
    the,
    validate,
    workloads,
)

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build_images.sh"
__all__ = ["chart"]  # the module-scoped fixture, shared

# The install shapes of deploy/k8s/README.md.
SHAPES: dict[str, dict[str, Any] | None] = {
    "default": None,
    "gpu-xl-8x2": {
        "encoder": {"flavor": "gpu", "size": "xl", "plan": {"cacheClaim": "gtr-plans"}},
        "index": {"shards": 8, "replicas": 2},
        "rerank": {"enabled": True, "gpu": True, "checkpoint": {"existingClaim": "celi"}},
    },
    "cpu-only": {"encoder": {"flavor": "cpu", "size": "base"}},
    "external-redis-no-rerank": {
        "redis": {"enabled": False, "external": {"existingSecret": "managed-redis"}},
        "rerank": {"enabled": False},
    },
}


@pytest.fixture(scope="module")
def built() -> dict[str, str]:
    """The references the build script tags its images with."""
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print"], capture_output=True, text=True, check=True
    ).stdout
    return dict(line.split("=", 1) for line in out.split())


def images_of(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    """container name → images, over every workload."""
    found: dict[str, set[str]] = {}
    for wl in workloads(docs):
        pod = wl["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            found.setdefault(f"{component(wl)}/{c['name']}", set()).add(c["image"])
    return found


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_validates_and_runs_the_built_images(
    chart: Any, built: dict[str, str], shape: str
) -> None:
    docs = render(chart, SHAPES[shape])
    for doc in docs:
        validate(doc)
    images = images_of(docs)
    gpu = shape != "cpu-only"  # encoder.flavor is gpu by default
    assert images["gateway/gateway"] == {built["APP"]}
    assert images["index/shard"] == {built["APP"]}
    assert images["triton/tritonserver"] == {built["TRITON" if gpu else "TRITON_CPU"]}
    if shape == "gpu-xl-8x2":
        assert images["rerank/rerank"] == {built["APP_GPU"]}
    if gpu:
        assert images["triton/build-plan"] == {built["APP_GPU"]}
    else:
        assert images["triton/prepare-model-repository"] == {built["TRITON_CPU"]}
    ours = {ref for refs in images.values() for ref in refs if "gtr-retrieval" in ref}
    assert ours <= set(built.values())
    if shape == "external-redis-no-rerank":
        assert not [d for d in docs if component(d) in {"redis", "rerank"}]


def test_gpu_xl_8x2_shape(chart: Any) -> None:
    docs = render(chart, SHAPES["gpu-xl-8x2"])
    shards = [d for d in of_kind(docs, "StatefulSet") if component(d) == "index"]
    assert len(shards) == 8 and {s["spec"]["replicas"] for s in shards} == {2}
    pod = the(docs, "Deployment", "triton")["spec"]["template"]["spec"]
    plans = next(v for v in pod["volumes"] if v["name"] == "plans")
    assert plans["persistentVolumeClaim"]["claimName"] == "gtr-plans"
    init = pod["initContainers"][0]
    assert "--model-dir=/model-src/checkpoint" in init["args"]
    assert "--onnx=/model-src/export/model.onnx" in init["args"]
    server = pod["containers"][0]
    assert {"name": "plans", "mountPath": "/plans", "readOnly": True} in server["volumeMounts"]
    assert "nvidia.com/gpu" in server["resources"]["limits"]


def test_cpu_triton_has_no_gpu_selector_and_no_plan(chart: Any) -> None:
    pod = the(render(chart, SHAPES["cpu-only"]), "Deployment", "triton")["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod
    assert "plans" not in {v["name"] for v in pod["volumes"]}


def test_triton_autoscaler_and_disruption_budget(chart: Any) -> None:
    metric = {
        "type": "Pods",
        "pods": {
            "metric": {"name": "nv_inference_queue_duration_us"},
            "target": {"type": "AverageValue", "averageValue": "5000"},
        },
    }
    values = {
        "encoder": {
            "autoscaling": {
                "enabled": True,
                "minReplicas": 2,
                "maxReplicas": 6,
                "metrics": [metric],
            }
        }
    }
    docs = render(chart, values)
    hpa = next(d for d in of_kind(docs, "HorizontalPodAutoscaler") if component(d) == "triton")
    validate(hpa)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"] == [metric]
    assert "replicas" not in the(docs, "Deployment", "triton")["spec"]
    pdb = next(d for d in of_kind(docs, "PodDisruptionBudget") if component(d) == "triton")
    assert pdb["spec"]["maxUnavailable"] == 1
    # off by default: a fixed replica count, no HPA
    default = render(chart, None)
    assert not [d for d in of_kind(default, "HorizontalPodAutoscaler") if component(d) == "triton"]


@pytest.mark.parametrize("where", ["gateway", "encoder"])
def test_an_autoscaler_whose_minimum_exceeds_its_maximum_is_refused(chart: Any, where: str) -> None:
    values = {where: {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}}
    with pytest.raises(
        Exception, match=rf"{where}.autoscaling: minReplicas 5 is above maxReplicas 2"
    ):
        render(chart, values)
    values[where]["autoscaling"]["maxReplicas"] = 5
    render(chart, values)  # min == max is fine


# --- Redis ------------------------------------------------------------------------------


def redis_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = the(docs, "StatefulSet", "redis")["spec"]["template"]["spec"]
    return spec


def test_redis_has_a_password_by_default(chart: Any) -> None:
    docs = render(chart, None)
    (secret,) = [d for d in of_kind(docs, "Secret") if component(d) == "redis"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    import base64

    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert len(password) == 40 and password.isalnum()
    server = redis_pod(docs)["containers"][0]
    # the shell that sets Redis's umask (test_deploy_chart) passes the password on
    assert server["command"] == ["sh", "-c"]
    (script,) = server["args"]
    assert script.endswith('exec redis-server /etc/redis/redis.conf --requirepass "$REDISCLI_AUTH"')
    (auth,) = server["env"]
    assert auth["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert "protected-mode yes" in configmap_data(docs, "redis")["redis.conf"]
    for wl in workloads(docs):
        if component(wl) in {"gateway", "index"}:
            env = wl["spec"]["template"]["spec"]["containers"][0]["env"]
            ref = next(e for e in env if e["name"] == "GTR_REDIS_PASSWORD")
            assert ref["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


def test_redis_uses_an_existing_secret_or_none(chart: Any) -> None:
    docs = render(chart, {"redis": {"auth": {"existingSecret": "mine"}}})
    assert not of_kind(docs, "Secret")
    assert redis_pod(docs)["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "mine"
    off = render(chart, {"redis": {"auth": {"enabled": False}}})
    assert not of_kind(off, "Secret")
    assert "protected-mode no" in configmap_data(off, "redis")["redis.conf"]


@pytest.mark.parametrize(
    ("limit", "percent", "expected"),
    [("4Gi", 75, 3 * 2**30), ("512Mi", 50, 256 * 2**20), ("16G", 80, 12_800_000_000)],
)
def test_redis_maxmemory_stays_below_the_container_limit(
    chart: Any, limit: str, percent: int, expected: int
) -> None:
    memory = {"limits": {"memory": limit}, "requests": {"memory": limit}}
    values = {"redis": {"maxmemoryPercent": percent, "resources": memory}}
    conf = configmap_data(render(chart, values), "redis")["redis.conf"].splitlines()
    assert f"maxmemory {expected}" in conf
    assert "maxmemory-policy noeviction" in conf


def test_redis_disruption_budget_and_exporter(chart: Any) -> None:
    docs = render(chart, {"redis": {"exporter": {"enabled": True}}})
    pdb = next(d for d in of_kind(docs, "PodDisruptionBudget") if component(d) == "redis")
    assert pdb["spec"]["maxUnavailable"] == 0
    exporter = next(c for c in redis_pod(docs)["containers"] if c["name"] == "exporter")
    assert exporter["ports"] == [{"name": "metrics", "containerPort": 9121, "protocol": "TCP"}]
    env = {e["name"]: e for e in exporter["env"]}
    assert env["REDIS_ADDR"]["value"] == "redis://127.0.0.1:6379"
    assert "secretKeyRef" in env["REDIS_PASSWORD"]["valueFrom"]
    service = next(
        d
        for d in of_kind(docs, "Service")
        if component(d) == "redis" and d["spec"].get("clusterIP") != "None"
    )
    assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    policy = next(d for d in of_kind(docs, "NetworkPolicy") if component(d) == "redis")
    assert [r["ports"][0]["port"] for r in policy["spec"]["ingress"]] == [6379, 9121]
    for doc in docs:
        validate(doc)


# --- separators: values, docs and the code agree ------------------------------------------


def test_shard_addresses_parse_as_the_chart_writes_them(chart: Any) -> None:
    docs = render(chart, {"index": {"shards": 3, "replicas": 2, "gatewayAddressing": "pods"}})
    shards = parse_shard_addresses(configmap_data(docs, "gateway")["GTR_GATEWAY_SHARDS"])
    assert [len(replicas) for replicas in shards] == [2, 2, 2]
    service = render(chart, {"index": {"shards": 3}})
    assert len(parse_shard_addresses(configmap_data(service, "gateway")["GTR_GATEWAY_SHARDS"])) == 3


def test_values_and_docs_name_the_separators_the_code_uses() -> None:
    values = (ROOT / "deploy" / "k8s" / "gtr-retrieval" / "values.yaml").read_text()
    assert '(";" between shards, "," between replicas)' in values
    for doc in ("docs/deploy.md", "deploy/k8s/README.md"):
        text = (ROOT / doc).read_text()
        assert "`|`-separated" not in text and '"|" between replicas' not in text, doc
        assert "`;` between shards" in text and "`,` between" in text, doc


def test_schema_keeps_images_in_one_place(chart: Any) -> None:
    values = yaml.safe_load((ROOT / "deploy" / "k8s" / "gtr-retrieval" / "values.yaml").read_text())
    assert "image" not in values and "image" not in values["encoder"]
    with pytest.raises(helm.HelmValuesError, match="image"):
        render_as_given(chart, {"image": {"tag": "1.0"}})
