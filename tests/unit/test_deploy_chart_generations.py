"""The chart's index generations (issue #24): the shards of every listed generation, the
rollout Job, the drift watcher, Triton's repository sync; rendered offline with
helm-python-sdk, every manifest validated against the Kubernetes 1.33 schemas
(kubernetes-validate, strict), linted and checked by checkov like the rest of the chart
(tests/unit/test_deploy_chart.py; the shared helpers are tests/support/chart.py's)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from services.cli.drift_commands import rollout_argv
from services.cli.main import build_parser
from services.index.client.addresses import parse_shard_addresses
from services.index.server.settings import ShardSettings
from services.rpc.settings import load_settings
from tests.support.chart import (
    NAMESPACE,
    PREPARE_SCRIPT,
    RELEASE,
    Manifest,
    chart,
    component,
    configmap_data,
    helm,
    lint_findings,
    of_kind,
    render,
    render_as_given,
    run_checkov,
    validate,
    with_auth,
)

FULL = f"{RELEASE}-gtr-retrieval"
__all__ = ["chart"]  # the module-scoped fixture, shared

G2 = {"name": "g2", "shards": 3}
ROLLING: dict[str, Any] = {
    "index": {
        "generations": [{"name": "g1"}, G2],
        "rollout": {"enabled": True, "name": "to-g2"},
        "drift": {"autoRollout": {"enabled": True, "threshold": 2.0, "window": "1h"}},
    },
    "encoder": {"flavor": "cpu", "repositorySync": {"enabled": True}},
    "metrics": {"serviceMonitor": {"enabled": True}},
}
NEW_ENCODER: dict[str, Any] = {
    "index": {
        "generations": [{"name": "g1"}, {"name": "g2"}],
        "rollout": {
            "enabled": True,
            "name": "minilm-v2",
            "retrain": False,
            "encoder": {"existingClaim": "checkpoints", "path": "minilm-v2"},
        },
    },
    "encoder": {"flavor": "cpu", "repositorySync": {"enabled": True}},
}


def shard_sets(docs: list[Manifest], generation: str) -> list[Manifest]:
    found = [
        d
        for d in of_kind(docs, "StatefulSet")
        if component(d) == "index"
        and d["spec"]["template"]["metadata"]["labels"].get("gtr-retrieval.io/generation", "g1")
        == generation
    ]
    return sorted(found, key=lambda d: d["metadata"]["name"])


def container(doc: Manifest, name: str | None = None) -> dict[str, Any]:
    spec = doc["spec"]["template"]["spec"]
    if name is None:
        return dict(spec["containers"][0])
    return next(c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name)


def parse(argv: list[str]) -> Any:
    """The rendered arguments, parsed by the real CLI (a flag it does not know fails)."""
    args, extra = build_parser().parse_known_args(argv)
    assert extra == [], extra
    return args


@pytest.mark.parametrize("values", [ROLLING, NEW_ENCODER], ids=["retrain-drift", "new-encoder"])
def test_generation_manifests_validate_and_lint(chart: Any, values: dict[str, Any]) -> None:
    docs = render(chart, values)
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        validate(doc)
        assert len(doc["metadata"]["name"]) <= 63
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys))
    findings = lint_findings(values)
    assert findings == [], findings


def test_the_default_is_generation_g1_as_before(chart: Any) -> None:
    """One g1 generation by default: the shards keep their names, labels and arguments (no
    --generation, no init container, no generations volume), and nothing else is made."""
    docs = render(chart)
    sets = shard_sets(docs, "g1")
    assert [s["metadata"]["name"] for s in sets] == [f"{FULL}-shard-0", f"{FULL}-shard-1"]
    for s, sts in enumerate(sets):
        pod = sts["spec"]["template"]["spec"]
        assert "initContainers" not in pod
        assert not any(a.startswith("--generation") for a in container(sts)["args"])
        assert "generations" not in {v["name"] for v in pod["volumes"]}
        assert sts["spec"]["selector"]["matchLabels"]["gtr-retrieval.io/shard"] == str(s)
    assert not [d for d in docs if component(d) in {"rollout", "drift"}]
    assert not [d for d in of_kind(docs, "PersistentVolumeClaim") if "generations" in str(d)]


def test_each_generation_gets_its_own_shards(chart: Any) -> None:
    docs = render(chart, {"index": {"generations": [{"name": "g1"}, G2]}})
    assert len(shard_sets(docs, "g1")) == 2
    g2 = shard_sets(docs, "g2")
    assert [s["metadata"]["name"] for s in g2] == [f"{FULL}-g2-shard-{s}" for s in range(3)]
    services = {d["metadata"]["name"]: d for d in of_kind(docs, "Service")}
    addresses = ";".join(
        f"dns:///{FULL}-g2-shard-{s}-headless.{NAMESPACE}.svc:50061" for s in range(3)
    )
    for s, sts in enumerate(g2):
        shard = container(sts)
        # the shard's own settings class takes the rendered flags
        settings = load_settings(ShardSettings, shard["args"][2:], prog="index serve")
        assert (settings.shard, settings.shards, settings.generation) == (s, 3, "g2")
        assert f"--shard={s}" in shard["args"] and "--shards=3" in shard["args"]
        assert "--generation=g2" in shard["args"]
        assert "--index-dir=/var/lib/gtr/generations/g2" in shard["args"]
        # no selector of g2 matches a g1 pod and no g1 selector a g2 pod
        selector = sts["spec"]["selector"]["matchLabels"]
        assert selector["gtr-retrieval.io/shard"] == f"g2.{s}"
        for g1 in shard_sets(docs, "g1"):
            g1_labels = g1["spec"]["template"]["metadata"]["labels"]
            assert not selector.items() <= g1_labels.items()
            pod_labels = sts["spec"]["template"]["metadata"]["labels"]
            assert not g1["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        headless = services[f"{FULL}-g2-shard-{s}-headless"]
        assert headless["spec"]["selector"] == selector
        # the pods wait for the rollout to train g2, then publish its addresses
        wait = container(sts, "await-generation")
        waited = parse(wait["args"])
        assert waited.generation == "g2" and waited.addresses == addresses
        assert waited.index_dir == "/var/lib/gtr/generations/g2"
        assert waited.shards == 3
        assert parse_shard_addresses(waited.addresses) == [[a] for a in addresses.split(";")]
        mounts = {m["name"]: m for m in shard["volumeMounts"]}
        assert mounts["generations"]["mountPath"] == "/var/lib/gtr/generations"
        assert mounts["generations"]["readOnly"] is True
    claims = [d for d in of_kind(docs, "PersistentVolumeClaim") if component(d) == "index"]
    assert [c["metadata"]["name"] for c in claims] == [f"{FULL}-generations"]
    assert claims[0]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claims[0]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # the gateway keeps g1's shards as its fallback; the serving one comes from the alias
    gateway_shards = configmap_data(docs, "gateway")["GTR_GATEWAY_SHARDS"]
    assert "g2" not in gateway_shards and gateway_shards.count(";") == 1


def test_pod_addressing_names_each_generations_pods(chart: Any) -> None:
    docs = render(
        chart,
        {"index": {"gatewayAddressing": "pods", "generations": [{"name": "g3", "replicas": 3}]}},
    )
    wait = parse(container(shard_sets(docs, "g3")[0], "await-generation")["args"])
    shards = parse_shard_addresses(wait.addresses)
    assert len(shards) == 2 and all(len(r) == 3 for r in shards)
    assert shards[1][2] == f"{FULL}-g3-shard-1-2.{FULL}-g3-shard-1-headless.{NAMESPACE}.svc:50061"
    assert shard_sets(docs, "g1") == []


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"index": {"generations": [{"name": "g1", "shards": 3}]}}, "index.shards is 2"),
        ({"index": {"generations": [{"name": "g2"}, {"name": "g2"}]}}, "lists g2 twice"),
        ({"index": {"rollout": {"enabled": True}}}, "/index/rollout/name"),
        ({"index": {"rollout": {"enabled": True, "name": "x", "retrain": False}}}, "encoder"),
        ({"index": {"generations": [{"name": "blue"}]}}, "/index/generations/0/name"),
        ({"index": {"generations": []}}, "/index/generations"),
        ({"index": {"drift": {"autoRollout": {"threshold": 0.9}}}}, "threshold"),
        ({"index": {"drift": {"autoRollout": {"window": "soon"}}}}, "window"),
        ({"index": {"rollout": {"name": "Not_A_Name"}}}, "/index/rollout/name"),
        (
            {**NEW_ENCODER, "encoder": {"flavor": "gpu", "repositorySync": {"enabled": True}}},
            "needs encoder.flavor cpu",
        ),
        ({**NEW_ENCODER, "encoder": {"flavor": "cpu"}}, "needs encoder.repositorySync.enabled"),
    ],
)
def test_bad_generation_values_are_refused(
    chart: Any, values: dict[str, Any], message: str
) -> None:
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as err:
        render_as_given(chart, with_auth(values))
    assert message in str(err.value)


def test_the_rollout_job_resumes_and_fails_fast_on_bad_input(chart: Any) -> None:
    docs = render(chart, ROLLING)
    (job,) = of_kind(docs, "Job")
    assert job["metadata"]["name"] == f"{FULL}-rollout-to-g2"
    spec = job["spec"]
    assert spec["backoffLimit"] == 20 and spec["podReplacementPolicy"] == "Failed"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [2]
    rollout = container(job)
    # the rendered flags, parsed by the real `index rollout`
    args = parse(rollout["args"])
    assert (args.index_command, args.retrain, args.encoder, args.yes) == (
        "rollout",
        True,
        None,
        True,
    )
    assert args.redis_url == "$(GTR_ROLLOUT_REDIS_URL)" and args.metrics_port == 9100
    assert args.triton_url == f"dns:///{FULL}-triton-headless.{NAMESPACE}.svc:8001"
    assert str(args.index_root) == "/var/lib/gtr/generations"
    # --retrain exports g1's vectors from its replicas: the gateway's g1 shards
    assert args.source_shards == configmap_data(docs, "gateway")["GTR_GATEWAY_SHARDS"]
    mounts = {m["name"]: m for m in rollout["volumeMounts"]}
    assert "readOnly" not in mounts["generations"]  # the builder writes the trained index
    assert {p["name"]: p["containerPort"] for p in rollout["ports"]} == {"metrics": 9100}
    metrics = next(
        d for d in of_kind(docs, "Service") if d["metadata"]["name"] == f"{FULL}-rollout"
    )
    assert metrics["spec"]["selector"]["app.kubernetes.io/component"] == "rollout"
    # the serving generation is never chosen by a workload: no argument or setting names it
    for doc in (d for d in docs if d["kind"] in {"Deployment", "StatefulSet", "Job"}):
        pod = doc["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            words = c.get("args", []) + [e["name"] for e in c.get("env", [])]
            assert not [w for w in words if "serving" in w.lower()], doc["metadata"]["name"]
    for data in (d.get("data", {}) for d in of_kind(docs, "ConfigMap")):
        assert not [k for k in data if "SERVING" in k.upper()]


@pytest.mark.parametrize("mutual", [True, False])
def test_the_rollout_job_reaches_tls_shards_with_the_release_certificate(
    chart: Any, mutual: bool
) -> None:
    """Under tls.enabled the shards serve TLS (and want a client certificate with
    tls.mutual): --retrain's export and the switch's wait are gRPC calls to them."""
    tls = {"tls": {"enabled": True, "existingSecret": "gtr-tls", "mutual": mutual}}
    docs = render(chart, {**ROLLING, **tls})
    (job,) = of_kind(docs, "Job")
    rollout = container(job)
    args = parse(rollout["args"])
    assert args.tls_ca == "/etc/gtr/tls/ca.crt"
    pair = ("/etc/gtr/tls/tls.crt", "/etc/gtr/tls/tls.key") if mutual else (None, None)
    assert (args.tls_client_cert, args.tls_client_key) == pair
    assert {m["name"]: m["mountPath"] for m in rollout["volumeMounts"]}["tls"] == "/etc/gtr/tls"
    # the drift watcher passes its own --tls-* on to the rollout it starts
    drift = next(d for d in of_kind(docs, "Deployment") if component(d) == "drift")
    started = parse(rollout_argv(parse(container(drift)["args"]))[3:])
    assert (started.tls_ca, started.tls_client_cert, started.tls_client_key) == (
        args.tls_ca,
        *pair,
    )
    plain = parse(container(of_kind(render(chart, ROLLING), "Job")[0])["args"])
    assert (plain.tls_ca, plain.tls_client_cert) == (None, None)


def _gateway_triton_tls(docs: list[Manifest]) -> tuple[str | None, str | None, str | None]:
    """The CA, client certificate and key the rendered gateway uses for Triton (its
    GatewaySettings.triton_client_tls: its --tls-* unless GTR_GATEWAY_TRITON_TLS is false)."""
    gateway = next(d for d in of_kind(docs, "Deployment") if component(d) == "gateway")
    own = {e["name"]: e["value"] for e in container(gateway)["env"] if "value" in e}
    env = {**configmap_data(docs, "gateway"), **own}
    if env.get("GTR_GATEWAY_TRITON_TLS", "true").lower() == "false":
        return None, None, None
    names = ("GTR_GATEWAY_TLS_CA", "GTR_GATEWAY_TLS_CLIENT_CERT", "GTR_GATEWAY_TLS_CLIENT_KEY")
    ca, cert, key = (env.get(n) for n in names)
    return ca, cert, key


@pytest.mark.parametrize(
    "tls", [None, {"mutual": True}, {"mutual": False}], ids=["plaintext", "mtls", "tls"]
)
def test_the_encoder_rollout_job_reaches_triton_as_the_gateway_does(
    chart: Any, tls: dict[str, Any] | None
) -> None:
    """`--encoder` publishes through Triton's gRPC port (the load) and re-embeds there: the
    Job passes the Triton TLS flags the gateway uses for Triton, no more. The chart's
    Triton serves plaintext under tls.enabled too (no --grpc-use-ssl; the gateway's
    GTR_GATEWAY_TRITON_TLS=false, docs/deploy.md "TLS"), so a --triton-ca there would
    open TLS to a plaintext port and fail every publish; once the chart gives Triton TLS,
    this fails until the Job follows the gateway."""
    values = dict(NEW_ENCODER)
    if tls is not None:
        values["tls"] = {"enabled": True, "existingSecret": "gtr-tls", **tls}
    docs = render(chart, values)
    (job,) = of_kind(docs, "Job")
    args = parse(container(job)["args"])
    assert args.encoder is not None
    expected = _gateway_triton_tls(docs)
    assert (args.triton_ca, args.triton_client_cert, args.triton_client_key) == expected
    triton = next(d for d in of_kind(docs, "Deployment") if component(d) == "triton")
    served_tls = [a for a in container(triton, "tritonserver")["args"] if "ssl" in a]
    # the gateway speaks TLS to Triton exactly when Triton serves it (today: never)
    assert (served_tls == []) == (expected == (None, None, None))
    if tls is not None:  # the shards' TLS is passed all the same (--tls-*)
        assert args.tls_ca == "/etc/gtr/tls/ca.crt"


def test_a_new_encoder_rollout_publishes_into_the_model_repository(chart: Any) -> None:
    docs = render(chart, NEW_ENCODER)
    (job,) = of_kind(docs, "Job")
    args = parse(container(job)["args"])
    assert (str(args.encoder), str(args.triton_repo), args.retrain) == (
        "/encoders/minilm-v2",
        "/model-src",
        False,
    )
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-source"]["persistentVolumeClaim"]["claimName"] == "gtr-model-repository"
    assert volumes["encoders"]["persistentVolumeClaim"] == {
        "claimName": "checkpoints",
        "readOnly": True,
    }
    # every Triton pod links and loads the new version beside the serving one
    triton = next(d for d in of_kind(docs, "Deployment") if component(d) == "triton")
    sync = container(triton, "repository-sync")
    assert sync["args"][:4] == ["/model-src", "/models", "2", "KIND_CPU"]
    assert sync["args"][4:] == ["--watch", "10", "--triton-http", "http://127.0.0.1:8000"]
    mounts = {m["name"]: m.get("readOnly", False) for m in sync["volumeMounts"]}
    assert mounts == {"model-source": True, "models": False, "scripts": True}


def test_the_drift_watcher_runs_the_same_rollout(chart: Any) -> None:
    docs = render(chart, ROLLING)
    drift = next(d for d in of_kind(docs, "Deployment") if component(d) == "drift")
    assert drift["spec"]["replicas"] == 1 and drift["spec"]["strategy"]["type"] == "Recreate"
    watch = container(drift)
    args = parse(watch["args"])
    assert (args.threshold, args.window, args.interval) == (2.0, 3600.0, 60.0)
    assert args.shards == configmap_data(docs, "gateway")["GTR_GATEWAY_SHARDS"]
    (job,) = of_kind(docs, "Job")
    job_args = container(job)["args"]
    shared = [a for a in job_args if a.startswith(("--triton-url", "--index-root", "--source"))]
    assert [a for a in args.rollout_arg if not a.startswith("--metrics-port")] == shared
    # the rollout the watcher would start, parsed by the real `index rollout`
    argv = rollout_argv(args)
    assert argv[:3] == [sys.executable, "-m", "services.cli.main"]
    started = parse(argv[3:])
    assert (started.index_command, started.retrain, started.yes) == ("rollout", True, True)
    assert started.redis_url == "$(GTR_DRIFT_REDIS_URL)" and started.metrics_port == 9101
    assert started.source_shards == args.shards
    ports = {p["name"]: p["containerPort"] for p in watch["ports"]}
    assert ports == {"metrics": 9100, "rollout-metrics": 9101}
    monitor = of_kind(docs, "ServiceMonitor")[0]
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics", "rollout-metrics"]


def test_the_builders_may_reach_redis_the_shards_and_triton(chart: Any) -> None:
    docs = render(chart, ROLLING)
    policies = {component(p): p for p in of_kind(docs, "NetworkPolicy")}
    for target in ("index", "triton", "redis"):
        peers = policies[target]["spec"]["ingress"][0]["from"]
        names = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers]
        assert {"rollout", "drift"} <= set(names), (target, names)
    for builder in ("rollout", "drift"):
        ingress = policies[builder]["spec"]["ingress"]
        assert len(ingress) == 1  # their metrics only
    pods = [d for d in docs if d["kind"] in {"Deployment", "StatefulSet", "Job"}]
    selectors = [p["spec"]["podSelector"]["matchLabels"] for p in policies.values()]
    for pod in pods:
        labels = pod["spec"]["template"]["metadata"]["labels"]
        assert any(sel.items() <= labels.items() for sel in selectors), pod["metadata"]["name"]


@pytest.mark.slow
def test_checkov_passes_on_generations(chart: Any, tmp_path: Path) -> None:
    run_checkov(render(chart, ROLLING), tmp_path)  # no failed check, only the allowed skips


def test_repository_sync_links_a_published_version_and_unlinks_a_removed_one(
    tmp_path: Path,
) -> None:
    source, dest = tmp_path / "src", tmp_path / "models"
    embed = source / "embed"
    (embed / "1").mkdir(parents=True)
    config = 'name: "embed"\ninstance_group { count: 1 kind: KIND_CPU }\n'
    (embed / "config.pbtxt").write_text(config)
    sys.path.insert(0, str(PREPARE_SCRIPT.parent))
    try:
        import prepare_model_repository as prep
    finally:
        sys.path.pop(0)
    assert prep.stage(str(source), str(dest), 2, "KIND_CPU") == (["embed"], ["embed"])
    assert prep.stage(str(source), str(dest), 2, "KIND_CPU") == (["embed"], [])  # unchanged
    (embed / "2").mkdir()  # a rollout published version 2
    (embed / "config.pbtxt").write_text(config + "version_policy { all {} }\n")
    (embed / ".publish.lock").touch()  # dotted: publish's own, never linked (a non-version
    (embed / ".staging-3").mkdir()  # entry newer than the load would reload every version)
    assert prep.stage(str(source), str(dest), 2, "KIND_CPU")[1] == ["embed"]
    assert not [p for p in (dest / "embed").iterdir() if p.name.startswith(".")]
    assert (dest / "embed" / "2").resolve() == (embed / "2").resolve()
    assert "version_policy" in (dest / "embed" / "config.pbtxt").read_text()
    (embed / "1").rmdir()  # retired
    assert prep.stage(str(source), str(dest), 2, "KIND_CPU")[1] == ["embed"]
    assert sorted(p.name for p in (dest / "embed").iterdir()) == ["2", "config.pbtxt"]
