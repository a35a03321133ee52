"""The Helm chart in deploy/k8s/gtr-retrieval, rendered offline with helm-python-sdk.

Every rendered manifest is validated against the Kubernetes 1.33 OpenAPI schemas
(kubernetes-validate, strict: unknown fields fail), and the properties the deployment
relies on are asserted on the objects themselves: one StatefulSet per shard, the
encoder size profile in the Triton Deployment, gRPC probes, security contexts. checkov
(scripts/bootstrap.sh installs it) runs on the rendered manifests. The rendering and
lookup helpers, shared with the chart's other tests, are tests/support/chart.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.chart import (
    ALLOWED_SKIPS,
    NAMESPACE,
    PREPARE_SCRIPT,
    RELEASE,
    ROOT,
    Manifest,
    chart,
    checkov_manifests,
    component,
    configmap_data,
    helm,
    kubernetes_validate,
    lint_findings,
    of_kind,
    render,
    render_as_given,
    run_checkov,
    the,
    validate,
    with_auth,
    workloads,
)

RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
__all__ = ["chart"]  # the module-scoped fixture, shared

# The GTR paper's encoder latencies (batch 1, 128 tokens) and the Triton instance counts:
# written out here, independently of values.yaml, so a drift in the chart fails.
PROFILES: dict[str, dict[str, int]] = {
    "base": {"slo_ms": 17, "instances": 2},
    "large": {"slo_ms": 34, "instances": 2},
    "xl": {"slo_ms": 96, "instances": 1},
    "xxl": {"slo_ms": 349, "instances": 1},
}
APP_COMPONENTS = {"gateway", "index", "rerank", "triton"}


FULL_VALUES: dict[str, Any] = {
    "rerank": {"enabled": True, "checkpoint": {"existingClaim": "celi-checkpoint"}},
    "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
    "redis": {"auth": {"existingSecret": "redis-auth"}},
    "index": {
        "gatewayAddressing": "pods",
        "podAntiAffinity": "hard",
        "trainedIndex": {"existingClaim": "trained-ivfpq"},
    },
}

CASES: dict[str, dict[str, Any] | None] = {
    "default": None,
    "cpu": {"encoder": {"flavor": "cpu"}},
    **{f"gpu-{size}": {"encoder": {"flavor": "gpu", "size": size}} for size in PROFILES},
    "shards-1": {"index": {"shards": 1, "replicas": 1}},
    "shards-4": {"index": {"shards": 4}},
    "gpu-shards": {"index": {"gpu": {"enabled": True, "device": 1}}},
    "plan-cache-claim": {"encoder": {"size": "xl", "plan": {"cacheClaim": "plans"}}},
    "plan-cache-emptydir": {
        "encoder": {"size": "xxl", "plan": {"cachePersistence": {"enabled": False}}}
    },
    "full": FULL_VALUES,
    "external-redis": {
        "redis": {"enabled": False, "external": {"url": "rediss://redis.example:6380/0"}}
    },
}


# --- lint and schema ---------------------------------------------------------------


@pytest.mark.parametrize("case", ["default", "cpu", "full", "external-redis"])
def test_lint_passes(case: str) -> None:
    findings = lint_findings(CASES[case])
    assert findings == [], findings


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"images": {"tag": "latest"}}, "/images/tag"),
        ({"encoder": {"size": "huge"}}, "/encoder/size"),
        ({"encoder": {"flavor": "tpu"}}, "/encoder/flavor"),
        ({"index": {"shards": 0}}, "/index/shards"),
        ({"redis": {"enabled": False}}, "/redis/external"),
        ({"redis": {"appendfsync": "no"}}, "/redis/appendfsync"),
        ({"rerank": {"enabled": True}}, "/rerank/checkpoint"),
        ({"podSecurityContext": {"runAsNonRoot": False}}, "/podSecurityContext/runAsNonRoot"),
        # null removes a default key, as `--set gateway.resources.limits=null` does
        ({"gateway": {"resources": {"limits": None}}}, "/gateway/resources"),
        # issue #15: the schema's holes
        (
            {"containerSecurityContext": {"privileged": True}},
            "/containerSecurityContext/privileged",
        ),
        (
            {"containerSecurityContext": {"readOnlyRootFilesystem": False}},
            "/containerSecurityContext/readOnlyRootFilesystem",
        ),
        # an SLO must be a bucket edge of the latency histograms (17 is, 18 is not)
        ({"encoder": {"profiles": {"base": {"sloMs": 18}}}}, "/encoder/profiles/base/sloMs"),
        (
            {"encoder": {"profiles": {"xl": {"searchSloMs": 140}}}},
            "/encoder/profiles/xl/searchSloMs",
        ),
        ({"redis": {"maxmemoryPercent": 100}}, "/redis/maxmemoryPercent"),
        ({"gateway": {"queryCache": {"maxEntries": 0}}}, "/gateway/queryCache/maxEntries"),
        ({"gateway": {"queryCache": {"ttlSeconds": 0}}}, "/gateway/queryCache/ttlSeconds"),
        ({"gateway": {"queryCache": {"enabled": "yes"}}}, "/gateway/queryCache/enabled"),
        ({"index": {"gpu": {"device": -1}}}, "/index/gpu/device"),
        ({"index": {"gpu": {"faiss": True}}}, "/index/gpu"),
        (
            {"encoder": {"profiles": {"xl": {"planMemory": "lots"}}}},
            "/encoder/profiles/xl/planMemory",
        ),
        (
            {"encoder": {"profiles": {"xxl": {"progressDeadlineSeconds": 5}}}},
            "/encoder/profiles/xxl/progressDeadlineSeconds",
        ),
        (
            {"encoder": {"plan": {"cachePersistence": {"accessModes": ["ReadOnlyMany"]}}}},
            "/encoder/plan/cachePersistence/accessModes/0",
        ),
        ({"encoder": {"plan": {"resources": {"requests": {"memory": "8Gi"}}}}}, "/encoder/plan"),
    ],
)
def test_schema_rejects_invalid_values(chart: Any, values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        render_as_given(chart, values)
    assert where in str(err.value)


def test_default_values_satisfy_schema(chart: Any) -> None:
    chart.validate_schema(None)


# --- every manifest is valid Kubernetes ---------------------------------------------


def test_validator_rejects_an_unknown_field() -> None:
    """The validator is live: a typo'd field in a Deployment fails strict validation."""
    bad = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "i:1", "livenesProbe": {}}]},
            },
        },
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)


@pytest.mark.parametrize("case", list(CASES))
def test_manifests_validate(chart: Any, case: str) -> None:
    docs = render(chart, CASES[case])
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # CRDs: not in the Kubernetes schemas, checked below
        validate(doc)
        assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
        assert len(doc["metadata"]["name"]) <= 63


def test_names_are_unique(chart: Any) -> None:
    docs = render(chart, FULL_VALUES | {"index": {**FULL_VALUES["index"], "shards": 4}})
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys))


# --- shards ----------------------------------------------------------------------------


@pytest.mark.parametrize(("shards", "replicas"), [(1, 1), (4, 2), (4, 3)])
def test_one_statefulset_per_shard(chart: Any, shards: int, replicas: int) -> None:
    docs = render(chart, {"index": {"shards": shards, "replicas": replicas}})
    sets = [d for d in of_kind(docs, "StatefulSet") if component(d) == "index"]
    assert len(sets) == shards
    headless = [d for d in of_kind(docs, "Service") if component(d) == "index"]
    assert len(headless) == shards
    for s, sts in enumerate(sorted(sets, key=lambda d: d["metadata"]["name"])):
        spec = sts["spec"]
        assert spec["replicas"] == replicas
        assert spec["serviceName"] == f"{RELEASE}-gtr-retrieval-shard-{s}-headless"
        assert spec["selector"]["matchLabels"]["gtr-retrieval.io/shard"] == str(s)
        args = spec["template"]["spec"]["containers"][0]["args"]
        assert f"--shard={s}" in args and f"--shards={shards}" in args
        # a replica seeds itself from the ready replicas of its own shard
        service = f"{RELEASE}-gtr-retrieval-shard-{s}-headless.{NAMESPACE}.svc:50061"
        assert f"--peers=dns:///{service}" in args
        assert [c["metadata"]["name"] for c in spec["volumeClaimTemplates"]] == ["data"]
        # replicas of one shard repel each other, and only each other
        term = spec["template"]["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ][0]["podAffinityTerm"]
        assert term["labelSelector"]["matchLabels"]["gtr-retrieval.io/shard"] == str(s)
    pdbs = [d for d in of_kind(docs, "PodDisruptionBudget") if component(d) == "index"]
    assert len(pdbs) == (shards if replicas > 1 else 0)
    targets = configmap_data(docs, "gateway")["GTR_GATEWAY_SHARDS"].split(";")
    assert targets == [
        f"dns:///{RELEASE}-gtr-retrieval-shard-{s}-headless.{NAMESPACE}.svc:50061"
        for s in range(shards)
    ]


def test_the_text_index_lives_on_the_replicas_volume(chart: Any) -> None:
    def args(values: dict[str, Any]) -> list[str]:
        docs = render(chart, values)
        sts = next(d for d in of_kind(docs, "StatefulSet") if component(d) == "index")
        container = sts["spec"]["template"]["spec"]["containers"][0]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/var/lib/gtr/data" in mounts  # the PVC that holds snapshots and text
        return list(container["args"])

    default = args({})
    assert "--text-dir=/var/lib/gtr/data/text" in default
    assert "--text-language=english" in default and "--no-text-index" not in default
    off = args({"index": {"textIndex": {"enabled": False, "language": "french"}}})
    assert "--no-text-index" in off and "--text-language=french" in off


def test_the_gateway_balances_over_tritons_headless_service(chart: Any) -> None:
    docs = render(chart, {"encoder": {"replicas": 3}})
    services = {d["metadata"]["name"]: d for d in of_kind(docs, "Service")}
    headless = services[f"{RELEASE}-gtr-retrieval-triton-headless"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is False
    assert headless["selector"] == services[f"{RELEASE}-gtr-retrieval-triton"]["spec"]["selector"]
    assert [p["name"] for p in headless["ports"]] == ["grpc"]  # scraped once, by the Service
    url = configmap_data(docs, "gateway")["GTR_GATEWAY_TRITON_URL"]
    assert url == f"dns:///{RELEASE}-gtr-retrieval-triton-headless.{NAMESPACE}.svc:8001"


def test_gateway_can_address_replicas_by_pod(chart: Any) -> None:
    docs = render(chart, {"index": {"shards": 2, "replicas": 3, "gatewayAddressing": "pods"}})
    shards = configmap_data(docs, "gateway")["GTR_GATEWAY_SHARDS"].split(";")
    assert len(shards) == 2
    for s, shard in enumerate(shards):
        name = f"{RELEASE}-gtr-retrieval-shard-{s}"
        assert shard.split(",") == [
            f"{name}-{r}.{name}-headless.{NAMESPACE}.svc:50061" for r in range(3)
        ]


def test_hard_anti_affinity_is_required(chart: Any) -> None:
    docs = render(chart, {"index": {"podAntiAffinity": "hard"}})
    for sts in (d for d in of_kind(docs, "StatefulSet") if component(d) == "index"):
        anti = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        assert list(anti) == ["requiredDuringSchedulingIgnoredDuringExecution"]


# --- encoder profile ----------------------------------------------------------------


@pytest.mark.parametrize("size", list(PROFILES))
def test_encoder_size_profile_lands_in_triton(chart: Any, size: str) -> None:
    expected = PROFILES[size]
    docs = render(chart, {"encoder": {"flavor": "gpu", "size": size}})
    triton = the(docs, "Deployment", "triton")
    meta = triton["metadata"]
    assert meta["labels"]["gtr-retrieval.io/encoder-size"] == size
    assert meta["annotations"]["gtr-retrieval.io/encode-slo-ms"] == str(expected["slo_ms"])
    assert meta["annotations"]["gtr-retrieval.io/instance-count"] == str(expected["instances"])
    pod = triton["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["name"] == "build-plan"
    assert init["args"][:2] == ["encoder", "ensure-plan"]
    assert f"--instances={expected['instances']}" in init["args"]
    assert init["resources"]["limits"]["nvidia.com/gpu"] == 1
    server = pod["containers"][0]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert server["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert server["image"] == "ghcr.io/gtr-retrieval/gtr-retrieval-triton:0.1.0"
    # no label only GPU Feature Discovery sets (issue #37 item 4): the GPU request places it
    assert "nodeSelector" not in pod
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    triton_config = configmap_data(docs, "triton")
    assert triton_config["instance-count"] == str(expected["instances"])
    assert triton_config["slo-ms"] == str(expected["slo_ms"])
    gateway_config = configmap_data(docs, "gateway")
    assert gateway_config["GTR_GATEWAY_ENCODER_SIZE"] == size
    # The gateway's SLOs follow from its size (services/common/slo.py), not from numbers.
    assert not [key for key in gateway_config if "SLO" in key]


def test_cpu_flavour_requests_no_gpu(chart: Any) -> None:
    docs = render(chart, {"encoder": {"flavor": "cpu", "size": "base"}})
    assert "nvidia.com/gpu" not in json.dumps(docs)
    triton = the(docs, "Deployment", "triton")
    pod = triton["spec"]["template"]["spec"]
    assert "tolerations" not in pod
    assert "--allow-gpu-metrics=false" in pod["containers"][0]["args"]
    assert triton["metadata"]["labels"]["gtr-retrieval.io/encoder-flavor"] == "cpu"
    # the profile's SLO still applies (it is the alerting threshold)
    assert configmap_data(docs, "triton")["slo-ms"] == "17"


# --- pods: probes, security, resources ------------------------------------------------


@pytest.mark.parametrize("case", ["default", "full"])
def test_probes_are_grpc_on_the_serving_port(chart: Any, case: str) -> None:
    """Our gRPC services: grpc.health.v1. Triton: KServe v2 HTTP health (ready, live)."""
    docs = render(chart, CASES[case])
    seen = set()
    for wl in workloads(docs):
        comp = component(wl)
        if comp not in APP_COMPONENTS:
            continue
        seen.add(comp)
        for c in wl["spec"]["template"]["spec"]["containers"]:
            if comp == "triton":
                paths = {
                    p: c[p]["httpGet"]["path"]
                    for p in ("startupProbe", "readinessProbe", "livenessProbe")
                }
                assert paths == {
                    "startupProbe": "/v2/health/ready",
                    "readinessProbe": "/v2/health/ready",
                    "livenessProbe": "/v2/health/live",
                }
                assert {c[p]["httpGet"]["port"] for p in paths} == {"http"}
                continue
            grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"] == {"port": grpc_port}, (comp, probe)
    assert seen == (APP_COMPONENTS if case == "full" else APP_COMPONENTS - {"rerank"})


@pytest.mark.parametrize("case", ["default", "cpu", "full"])
def test_pods_are_locked_down(chart: Any, case: str) -> None:
    docs = render(chart, CASES[case])
    assert workloads(docs)
    for wl in workloads(docs):
        name = wl["metadata"]["name"]
        pod = wl["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["securityContext"]["runAsUser"] >= 10000, name
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (name, c["name"], kind)
            image = c["image"]
            tag = image.rsplit(":", 1)[-1] if "@" not in image else "digest"
            assert ":" in image and tag != "latest", image


@pytest.mark.parametrize("case", ["default", "cpu", "full"])
def test_data_volumes_belong_to_the_pods_group_and_secrets_to_no_other_user(
    chart: Any, case: str
) -> None:
    """Issue #33 point 3 in the chart: every pod sets ``fsGroup`` (its PVCs and emptyDirs,
    where Redis's AOF, the shards' snapshots and the indexes live, are owned by the pod's
    group, not left to the image's defaults), and every Secret volume (tokens, TLS keys)
    is mounted without bits for other users. ConfigMap volumes keep Kubernetes' 0644:
    they hold configuration and scripts, no data and no secret (Redis's password comes
    from a Secret, never its ConfigMap)."""
    docs = render(chart, CASES[case])
    secrets = 0
    for wl in workloads(docs):
        name = wl["metadata"]["name"]
        pod = wl["spec"]["template"]["spec"]
        context = pod["securityContext"]
        assert context["fsGroup"] == context["runAsGroup"], name
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                secrets += 1
                mode = volume["secret"].get("defaultMode", 0o644)
                assert mode & 0o007 == 0, (name, volume["name"], oct(mode))
            if "configMap" in volume:
                assert "password" not in str(volume).lower(), (name, volume)
    assert secrets > 0  # the token Secret at least (every case renders with tokens)


@pytest.mark.parametrize("case", ["default", "full"])
def test_termination_grace_exceeds_the_drain(chart: Any, case: str) -> None:
    docs = render(chart, CASES[case])
    config = {
        "gateway": configmap_data(docs, "gateway")["GTR_GATEWAY_GRACE_SECONDS"],
        "index": configmap_data(docs, "index")["GTR_SHARD_GRACE_SECONDS"],
    }
    for wl in workloads(docs):
        comp = component(wl)
        if comp not in APP_COMPONENTS:
            continue
        pod = wl["spec"]["template"]["spec"]
        main = pod["containers"][0]
        pre_stop = main["lifecycle"]["preStop"]["sleep"]["seconds"]
        if comp == "triton":
            grace = next(
                int(a.split("=", 1)[1]) for a in main["args"] if a.startswith("--exit-timeout")
            )
        elif comp in config:
            grace = int(config[comp])
        else:
            grace = int(configmap_data(docs, comp)["GTR_RERANK_GRACE_SECONDS"])
        assert pod["terminationGracePeriodSeconds"] > pre_stop + grace, comp


def test_every_pod_is_covered_by_a_network_policy(chart: Any) -> None:
    docs = render(chart, FULL_VALUES)
    selectors = [p["spec"]["podSelector"]["matchLabels"] for p in of_kind(docs, "NetworkPolicy")]
    for wl in workloads(docs):
        labels = wl["spec"]["template"]["metadata"]["labels"]
        assert any(sel.items() <= labels.items() for sel in selectors), wl["metadata"]["name"]
    shard_policy = next(p for p in of_kind(docs, "NetworkPolicy") if component(p) == "index")
    peers = shard_policy["spec"]["ingress"][0]["from"]
    # the gateway, and shard pods: a new replica fetches its snapshot from a peer (--peers)
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers] == [
        "gateway",
        "index",
    ]
    for sts in (s for s in of_kind(docs, "StatefulSet") if component(s) == "index"):
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert peers[1]["podSelector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("http_port", [8080, 0])
def test_the_gateways_http_port_is_served_exposed_and_let_in(chart: Any, http_port: int) -> None:
    """gateway.httpPort (docs/http.md): the gateway's env, a container port and a Service
    port named http, and the network policy's ingress beside the gRPC port; 0: none."""
    values = {**FULL_VALUES, "gateway": {"httpPort": http_port}}
    docs = render(chart, values)
    env = configmap_data(docs, "gateway")
    (container,) = the(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    service = next(
        s for s in of_kind(docs, "Service") if s["metadata"]["name"].endswith("-gateway")
    )
    policy = the(docs, "NetworkPolicy", "gateway")
    allowed = [p["port"] for p in policy["spec"]["ingress"][0]["ports"]]
    if http_port:
        assert env["GTR_GATEWAY_HTTP_PORT"] == str(http_port)
        assert {"name": "http", "containerPort": http_port, "protocol": "TCP"} in container["ports"]
        assert any(p["name"] == "http" and p["port"] == http_port for p in service["spec"]["ports"])
        assert allowed == [50051, http_port]
    else:
        assert "GTR_GATEWAY_HTTP_PORT" not in env
        assert "http" not in {p["name"] for p in container["ports"]}
        assert "http" not in {p["name"] for p in service["spec"]["ports"]}
        assert allowed == [50051]


# --- Redis ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["default", "full"])
def test_redis_writes_its_files_for_its_user_only(chart: Any, case: str) -> None:
    """Issue #33 point 3: Redis has no umask option; its container sets 077 before it
    execs redis-server, so the AOF and RDB on the PVC are 0600; the password (when there
    is one) still comes from the Secret's environment variable."""
    docs = render(chart, CASES[case])
    pod = the(docs, "StatefulSet", "redis")["spec"]["template"]["spec"]
    redis = next(c for c in pod["containers"] if c["name"] == "redis")
    assert redis["command"] == ["sh", "-c"]
    (script,) = redis["args"]
    assert script.startswith("umask 077 && exec redis-server /etc/redis/redis.conf"), script
    if "--requirepass" in script:
        assert script.endswith('--requirepass "$REDISCLI_AUTH"'), script
        assert any(e["name"] == "REDISCLI_AUTH" for e in redis["env"])


def test_redis_is_durable(chart: Any) -> None:
    docs = render(chart, None)
    conf = configmap_data(docs, "redis")["redis.conf"].splitlines()
    assert "appendonly yes" in conf
    assert "appendfsync everysec" in conf
    assert "maxmemory-policy noeviction" in conf
    # 75 % of the 4Gi limit: writes are refused before the container is OOM-killed
    assert f"maxmemory {4 * 2**30 * 75 // 100}" in conf
    redis = the(docs, "StatefulSet", "redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    url = next(
        e["value"]
        for e in the(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0][
            "env"
        ]
        if e["name"] == "GTR_GATEWAY_REDIS_URL"
    )
    # AUTH by default, the password from the chart's Secret
    assert url == f"redis://:$(GTR_REDIS_PASSWORD)@{RELEASE}-gtr-retrieval-redis:6379/0"


def test_external_redis_replaces_the_statefulset(chart: Any) -> None:
    docs = render(chart, CASES["external-redis"])
    assert not [d for d in docs if component(d) == "redis"]
    for wl in workloads(docs):
        if component(wl) not in {"gateway", "index"}:
            continue
        env = {
            e["name"]: e.get("value")
            for e in wl["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        var = "GTR_GATEWAY_REDIS_URL" if component(wl) == "gateway" else "GTR_SHARD_REDIS_URL"
        assert env[var] == "rediss://redis.example:6380/0"


# --- monitoring -------------------------------------------------------------------------


def test_monitoring_objects_are_optional(chart: Any) -> None:
    kinds = {d["kind"] for d in render(chart, None)}
    assert not kinds & {"ServiceMonitor", "PrometheusRule"}


def test_prometheus_rule_carries_rules_yml(chart: Any) -> None:
    docs = render(chart, FULL_VALUES)
    (rule,) = of_kind(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text(encoding="utf-8"))
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/component"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    # every Service that the monitor selects names its metrics port "metrics", except
    # Triton's headless one (gRPC only: its pods are scraped once, through the Service)
    triton_headless = f"{RELEASE}-gtr-retrieval-triton-headless"
    for svc in of_kind(docs, "Service"):
        ports = {p["name"] for p in svc["spec"]["ports"]}
        if svc["metadata"]["name"] == triton_headless:
            assert ports == {"grpc"}
        elif component(svc) in APP_COMPONENTS:
            assert "metrics" in ports, svc["metadata"]["name"]


# --- the Triton init script ---------------------------------------------------------------


def _model(root: Path, name: str, config: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.plan").write_bytes(b"engine")
    (root / name / "config.pbtxt").write_text(config, encoding="utf-8")


def _prepare(source: Path, dest: Path, count: int, kind: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PREPARE_SCRIPT), str(source), str(dest), str(count), kind],
        capture_output=True,
        text=True,
        check=False,
    )


# The layout protobuf's text_format writes (services/encoder/build/repository.py), and the
# bracketed one people write by hand.
ENCODER_GPU = 'name: "encoder"\ninstance_group {\n  count: 1\n  kind: KIND_GPU\n}\n'
TOKENIZER_CPU = 'name: "tokenizer"\ninstance_group [ { count: 2 kind: KIND_CPU } ]\n'
ENSEMBLE = 'name: "embed"\nplatform: "ensemble"\n'


def test_prepare_model_repository_sets_the_gpu_instance_count(tmp_path: Path) -> None:
    source, dest = tmp_path / "src", tmp_path / "models"
    _model(source, "encoder", ENCODER_GPU)
    _model(source, "tokenizer", TOKENIZER_CPU)
    _model(source, "embed", ENSEMBLE)
    done = _prepare(source, dest, 3, "KIND_GPU")
    assert done.returncode == 0, done.stderr
    assert (dest / "encoder" / "config.pbtxt").read_text() == ENCODER_GPU.replace(
        "count: 1", "count: 3"
    )
    # the CPU tokenizer of the GPU flavour and the ensemble keep their config
    assert (dest / "tokenizer" / "config.pbtxt").read_text() == TOKENIZER_CPU
    assert (dest / "embed" / "config.pbtxt").read_text() == ENSEMBLE
    # the version directories are linked, not copied; the source is untouched
    assert os.path.islink(dest / "encoder" / "1")
    assert (dest / "encoder" / "1" / "model.plan").read_bytes() == b"engine"
    assert (source / "encoder" / "config.pbtxt").read_text() == ENCODER_GPU


def test_prepare_model_repository_sets_the_cpu_instance_count(tmp_path: Path) -> None:
    source, dest = tmp_path / "src", tmp_path / "models"
    _model(source, "tokenizer", TOKENIZER_CPU)
    done = _prepare(source, dest, 1, "KIND_CPU")
    assert done.returncode == 0, done.stderr
    assert "{ count: 1 kind: KIND_CPU }" in (dest / "tokenizer" / "config.pbtxt").read_text()


def test_prepare_model_repository_fails_without_a_matching_group(tmp_path: Path) -> None:
    source = tmp_path / "src"
    _model(source, "embed", ENSEMBLE)
    _model(source, "tokenizer", TOKENIZER_CPU)
    done = _prepare(source, tmp_path / "models", 2, "KIND_GPU")
    assert done.returncode == 1
    assert "instance_group of KIND_GPU" in done.stderr


# --- checkov ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["default", "full"])
def test_checkov_passes(chart: Any, case: str, tmp_path: Path) -> None:
    docs = render(chart, CASES[case])
    results = run_checkov(docs, tmp_path)  # no failed check, only the allowed skips
    assert len(results["passed_checks"]) > 100
    # each suppression is documented with its reason in the annotation itself
    for wl in workloads(checkov_manifests(docs)):
        for key, value in wl["metadata"].get("annotations", {}).items():
            if key.startswith("checkov.io/skip"):
                check, _, reason = value.partition("=")
                assert check in ALLOWED_SKIPS and len(reason) > 20, (key, value)


# --- authentication and TLS (issue #13 items 1, 2) ------------------------------------


def _env(doc: Manifest) -> dict[str, str]:
    container = doc["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _secret_volumes(doc: Manifest) -> dict[str, str]:
    volumes = doc["spec"]["template"]["spec"]["volumes"]
    return {v["name"]: v["secret"]["secretName"] for v in volumes if "secret" in v}


def test_without_tokens_the_chart_does_not_render(chart: Any) -> None:
    """Tokens are required by default: no Secret and no tokens is an error that says
    what to set (and how to turn auth off explicitly)."""
    with pytest.raises(helm.HelmRenderError) as err:
        render_as_given(chart, None)
    assert "auth.existingSecret" in str(err.value) and "auth.enabled=false" in str(err.value)


def test_tokens_from_values_become_a_secret_mounted_for_the_gateway(chart: Any) -> None:
    read, write = "r" * 32, "w" * 32
    docs = render(chart, {"auth": {"enabled": True, "readTokens": [read], "writeTokens": [write]}})
    secrets = [d for d in of_kind(docs, "Secret") if d["metadata"]["name"].endswith("-tokens")]
    assert len(secrets) == 1
    data = secrets[0]["stringData"]
    assert data["read-tokens"].split() == [read] and data["write-tokens"].split() == [write]
    gateway = the(docs, "Deployment", "gateway")
    env = _env(gateway)
    assert env["GTR_GATEWAY_READ_TOKENS_FILE"] == "/etc/gtr/tokens/read-tokens"
    assert env["GTR_GATEWAY_WRITE_TOKENS_FILE"] == "/etc/gtr/tokens/write-tokens"
    assert "GTR_GATEWAY_AUTH" not in env
    assert _secret_volumes(gateway)["tokens"] == secrets[0]["metadata"]["name"]
    mounts = gateway["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    tokens = next(m for m in mounts if m["name"] == "tokens")
    assert "subPath" not in tokens  # a subPath mount never sees a rotated Secret


def test_an_existing_token_secret_is_mounted_and_none_is_made(chart: Any) -> None:
    docs = render(chart, {"auth": {"enabled": True, "existingSecret": "mine"}})
    assert not [d for d in of_kind(docs, "Secret") if d["metadata"]["name"].endswith("-tokens")]
    assert _secret_volumes(the(docs, "Deployment", "gateway"))["tokens"] == "mine"


def test_auth_off_is_explicit(chart: Any) -> None:
    docs = render(chart, {"auth": {"enabled": False}})
    gateway = the(docs, "Deployment", "gateway")
    assert _env(gateway)["GTR_GATEWAY_AUTH"] == "false"
    assert "tokens" not in _secret_volumes(gateway)


TLS_VALUES: dict[str, Any] = {
    **FULL_VALUES,
    "tls": {"enabled": True, "existingSecret": "gtr-tls"},
}


def test_tls_on_every_hop_with_probes_on_the_plaintext_health_port(chart: Any) -> None:
    docs = render(chart, TLS_VALUES)
    for doc in docs:
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            validate(doc)
    seen = set()
    for wl in workloads(docs):
        comp = component(wl)
        if comp not in {"gateway", "index", "rerank"}:
            continue
        seen.add(comp)
        prefix = {"gateway": "GTR_GATEWAY", "index": "GTR_SHARD", "rerank": "GTR_RERANK"}[comp]
        env = _env(wl)
        assert env[f"{prefix}_TLS_CERT"] == "/etc/gtr/tls/tls.crt", comp
        assert env[f"{prefix}_TLS_KEY"] == "/etc/gtr/tls/tls.key", comp
        assert env[f"{prefix}_HEALTH_PORT"] == "8090", comp
        assert _secret_volumes(wl)["tls"] == "gtr-tls", comp
        container = wl["spec"]["template"]["spec"]["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": 8090}, (comp, probe)
        if comp == "gateway":
            # public side TLS only (clientAuth off); mTLS to shards and rerank; Triton plain
            assert "GTR_GATEWAY_TLS_CLIENT_CA" not in env
            assert env["GTR_GATEWAY_TLS_CA"] == "/etc/gtr/tls/ca.crt"
            assert env["GTR_GATEWAY_TLS_CLIENT_CERT"] == "/etc/gtr/tls/tls.crt"
            assert env["GTR_GATEWAY_TRITON_TLS"] == "false"
        else:
            assert env[f"{prefix}_TLS_CLIENT_CA"] == "/etc/gtr/tls/ca.crt", comp
    assert seen == {"gateway", "index", "rerank"}


def test_tls_without_mutual_asks_no_client_certificate(chart: Any) -> None:
    docs = render(chart, {"tls": {"enabled": True, "existingSecret": "gtr-tls", "mutual": False}})
    assert "GTR_SHARD_TLS_CLIENT_CA" not in _env(of_kind(docs, "StatefulSet")[0])
    assert "GTR_GATEWAY_TLS_CLIENT_CERT" not in _env(the(docs, "Deployment", "gateway"))


def test_tls_needs_its_secret(chart: Any) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        render_as_given(chart, with_auth({"tls": {"enabled": True}}))
    assert "/tls/existingSecret" in str(err.value)


@pytest.mark.parametrize("mutual", [True, False])
def test_shard_pods_seed_from_their_peers_over_tls(chart: Any, mutual: bool) -> None:
    """A new shard pod fetches its snapshot from a peer (--peers, the shard's headless
    Service) through the shards' TLS: it needs the CA, and with mutual TLS the client
    certificate the peer requires; every variable is one ShardSettings reads."""
    from services.index.server.settings import ShardSettings

    values = {**TLS_VALUES, "tls": {"enabled": True, "existingSecret": "gtr-tls", "mutual": mutual}}
    docs = render(chart, values)
    headless = {
        f"{s['metadata']['name']}.{NAMESPACE}.svc"
        for s in of_kind(docs, "Service")
        if s["spec"].get("clusterIP") == "None"
    }
    statefulsets = [s for s in of_kind(docs, "StatefulSet") if component(s) == "index"]
    assert len(statefulsets) == 2  # index.shards
    for sts in statefulsets:
        container = sts["spec"]["template"]["spec"]["containers"][0]
        (peers,) = [a.removeprefix("--peers=") for a in container["args"] if "--peers=" in a]
        host = peers.removeprefix("dns:///").rsplit(":", 1)[0]
        assert host in headless, (peers, headless)
        env = _env(sts)
        assert env["GTR_SHARD_TLS_CA"] == "/etc/gtr/tls/ca.crt"
        if mutual:
            assert env["GTR_SHARD_TLS_CLIENT_CERT"] == "/etc/gtr/tls/tls.crt"
            assert env["GTR_SHARD_TLS_CLIENT_KEY"] == "/etc/gtr/tls/tls.key"
        else:
            assert "GTR_SHARD_TLS_CLIENT_CERT" not in env and "GTR_SHARD_TLS_CLIENT_KEY" not in env
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["tls"] == "/etc/gtr/tls"
        fields = set(ShardSettings.model_fields)
        for name in env:
            if name.startswith("GTR_SHARD_"):
                assert name.removeprefix("GTR_SHARD_").lower() in fields, name


def _gateway_settings(docs: list[Manifest], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The gateway's settings as its process would read them from the ConfigMap."""
    from services.gateway.settings import GatewaySettings
    from services.rpc.settings import load_settings

    for name in list(os.environ):
        if name.startswith("GTR_GATEWAY_"):
            monkeypatch.delenv(name)
    for name, value in configmap_data(docs, "gateway").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GTR_GATEWAY_REDIS_URL", "redis://redis:6379/0")
    monkeypatch.setenv("GTR_GATEWAY_AUTH", "false")
    return load_settings(GatewaySettings)


def test_the_query_cache_is_off_by_default(chart: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(chart)
    assert configmap_data(docs, "gateway")["GTR_GATEWAY_QUERY_CACHE"] == "false"
    assert not _gateway_settings(docs, monkeypatch).query_cache


def test_query_cache_values_reach_the_gateway(chart: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = {"enabled": True, "ttlSeconds": 90.5, "maxEntries": 2_000_000}
    docs = render(chart, {"gateway": {"queryCache": cache}})
    data = configmap_data(docs, "gateway")
    assert data["GTR_GATEWAY_QUERY_CACHE_MAX_ENTRIES"] == "2000000"  # not 2e+06
    settings = _gateway_settings(docs, monkeypatch)
    assert settings.query_cache
    assert settings.query_cache_ttl_s == 90.5 and settings.query_cache_max_entries == 2_000_000
    # the pod rolls when the cache is switched: the ConfigMap's checksum changes
    gateway = the(docs, "Deployment", "gateway")
    default = the(render(chart), "Deployment", "gateway")
    key = "checksum/config"
    annotations = gateway["spec"]["template"]["metadata"]["annotations"]
    assert annotations[key] != default["spec"]["template"]["metadata"]["annotations"][key]


# --- the GPU path (issue #25 items 4, 6, 8) -------------------------------------------


def _shard_pod(docs: list[Manifest]) -> dict[str, Any]:
    sts = next(d for d in of_kind(docs, "StatefulSet") if component(d) == "index")
    pod: dict[str, Any] = sts["spec"]["template"]["spec"]
    return pod


def test_index_shards_stay_on_the_cpu_by_default(chart: Any) -> None:
    docs = render(chart)
    pod = _shard_pod(docs)
    assert pod["containers"][0]["image"].endswith("/gtr-retrieval:0.1.0")
    assert "nvidia.com/gpu" not in json.dumps(pod)
    assert configmap_data(docs, "index")["GTR_SHARD_GPU"] == "false"


def test_gpu_shards_get_the_faiss_gpu_image_a_gpu_and_the_gpu_nodes(chart: Any) -> None:
    """Item 4: index.gpu.enabled renders GPU shards: images.appGpu (faiss-gpu), one GPU
    per replica, the GPU nodes' taint tolerated and label required, the copy's settings
    (names the shard's settings class has), index.gpu.resources."""
    from services.index.server.settings import ShardSettings

    values = {
        "index": {
            "shards": 2,
            "gpu": {"enabled": True, "device": 1},
            "nodeSelector": {"pool": "search"},
            "tolerations": [{"key": "search", "operator": "Exists", "effect": "NoSchedule"}],
        },
        "images": {"digests": {"appGpu": "sha256:" + "a" * 64}},
    }
    docs = render(chart, values)
    statefulsets = [d for d in of_kind(docs, "StatefulSet") if component(d) == "index"]
    assert len(statefulsets) == 2
    for sts in statefulsets:
        pod = sts["spec"]["template"]["spec"]
        (shard,) = pod["containers"]
        assert shard["image"] == "ghcr.io/gtr-retrieval/gtr-retrieval-gpu@sha256:" + "a" * 64
        resources = shard["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == 1
        assert resources["limits"]["nvidia.com/gpu"] == 1
        assert resources["limits"]["memory"] == "16Gi"  # index.gpu.resources
        assert pod["nodeSelector"] == {"pool": "search"}  # no GFD-only label by default
        keys = {t["key"] for t in pod["tolerations"]}
        assert keys == {"search", "nvidia.com/gpu"}
        assert sts["spec"]["template"]["metadata"]["annotations"]["gtr-retrieval.io/gpu"] == "true"
    config = configmap_data(docs, "index")
    assert config["GTR_SHARD_GPU"] == "true" and config["GTR_SHARD_GPU_DEVICE"] == "1"
    fields = {f"GTR_SHARD_{name.upper()}" for name in ShardSettings.model_fields}
    assert {"GTR_SHARD_GPU", "GTR_SHARD_GPU_DEVICE"} <= fields
    from pydantic import TypeAdapter

    assert TypeAdapter(bool).validate_python(config["GTR_SHARD_GPU"]) is True


def _triton(docs: list[Manifest]) -> tuple[Manifest, dict[str, Any]]:
    triton = the(docs, "Deployment", "triton")
    return triton, triton["spec"]["template"]["spec"]


def _bytes(quantity: str | int) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    text = str(quantity)
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


# FP32 weights of the GTR encoders (parameters × 4 bytes): the plan build holds the FP32
# ONNX graph and its FP16 copy (and TensorRT its own FP16 weights) in host memory.
FP32_WEIGHTS_GB = {"base": 0.44, "large": 1.3, "xl": 4.9, "xxl": 19.0}


@pytest.mark.parametrize("size", list(PROFILES))
def test_the_plan_build_gets_the_memory_of_its_size(chart: Any, size: str) -> None:
    """Item 6: the build-plan init container's memory follows the size (one 16 GiB limit
    for every size ran xl/xxl out of memory): request = limit, at least the FP32 graph +
    its FP16 copy + TensorRT's FP16 weights (2x the FP32 weights)."""
    _, pod = _triton(render(chart, {"encoder": {"size": size}}))
    (build,) = pod["initContainers"]
    resources = build["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert _bytes(resources["limits"]["memory"]) >= 2 * FP32_WEIGHTS_GB[size] * 1e9
    assert _bytes(resources["limits"]["memory"]) >= 8 * 2**30


@pytest.mark.parametrize("size", list(PROFILES))
def test_a_cold_rollout_has_the_time_and_disk_of_its_size(chart: Any, size: str) -> None:
    """Item 8: progressDeadlineSeconds from the size profile (above the model's startup
    budget), the plan cache on a PVC of the chart's when enabled (kept on uninstall; by
    default an emptyDir: issue #37 item 4), and ephemeral storage requested for the
    emptyDirs the pod fills."""
    cache = {"cachePersistence": {"enabled": True}}
    docs = render(chart, {"encoder": {"size": size, "plan": cache}})
    triton, pod = _triton(docs)
    deadline = triton["spec"]["progressDeadlineSeconds"]
    assert deadline > 900  # encoder.startupTimeoutSeconds: the load alone
    assert deadline >= {"base": 1200, "large": 1500, "xl": 2400, "xxl": 3600}[size]
    (pvc,) = of_kind(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == f"{RELEASE}-gtr-retrieval-plans"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["plans"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    limits = {
        n: _bytes(v["emptyDir"]["sizeLimit"])
        for n, v in volumes.items()
        if "emptyDir" in v and n != "shm"
    }
    assert set(limits) == {"models", "tmp"}
    (build,) = pod["initContainers"]
    (server,) = pod["containers"]
    assert _bytes(build["resources"]["requests"]["ephemeral-storage"]) == sum(limits.values())
    assert _bytes(server["resources"]["requests"]["ephemeral-storage"]) == limits["models"]
    assert sum(limits.values()) <= 64 * 2**30  # was 128 Gi of emptyDirs, none requested


def test_the_plan_cache_can_be_an_existing_claim_or_an_emptydir(chart: Any) -> None:
    docs = render(chart, CASES["plan-cache-claim"])
    assert not of_kind(docs, "PersistentVolumeClaim")
    _, pod = _triton(docs)
    plans = {v["name"]: v for v in pod["volumes"]}["plans"]
    assert plans["persistentVolumeClaim"]["claimName"] == "plans"
    docs = render(chart, CASES["plan-cache-emptydir"])
    assert not of_kind(docs, "PersistentVolumeClaim")
    _, pod = _triton(docs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["plans"]["emptyDir"]["sizeLimit"] == "16Gi"
    (build,) = pod["initContainers"]
    disk = sum(_bytes(volumes[n]["emptyDir"]["sizeLimit"]) for n in ("models", "plans", "tmp"))
    assert _bytes(build["resources"]["requests"]["ephemeral-storage"]) == disk


def test_the_cpu_flavour_makes_no_plan_cache(chart: Any) -> None:
    docs = render(chart, {"encoder": {"flavor": "cpu", "size": "xxl"}})
    assert not of_kind(docs, "PersistentVolumeClaim")
    triton, _ = _triton(docs)
    assert triton["spec"]["progressDeadlineSeconds"] == 600
