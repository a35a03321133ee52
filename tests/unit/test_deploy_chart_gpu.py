"""The chart's GPU parts (issue #37): what restarts the GPU Triton pods (item 6), and
defaults that install on a plain managed GPU cluster (item 4): no ReadWriteMany volume,
no label only GPU Feature Discovery sets, GPUs requested and their taint tolerated, and
runtimeClassName / affinity as values. Rendered offline with helm-python-sdk and validated
with kubernetes-validate, as in test_deploy_chart.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.chart import chart, helm, of_kind, render, the, validate

__all__ = ["chart"]  # the module-scoped fixture, shared


def _pod_template(docs: list[dict[str, Any]], kind: str, comp: str) -> dict[str, Any]:
    template: dict[str, Any] = the(docs, kind, comp)["spec"]["template"]
    return template


# --- item 6: only what Triton reads restarts Triton -----------------------------------


@pytest.mark.parametrize("flavor", ["gpu", "cpu"])
def test_an_index_or_gateway_value_leaves_tritons_pods_unchanged(chart: Any, flavor: str) -> None:
    base = {"encoder": {"flavor": flavor}}
    before = _pod_template(render(chart, base), "Deployment", "triton")
    for change in (
        {"index": {"shards": 4, "gpu": {"enabled": True}}},
        {"gateway": {"queryCache": {"enabled": True}}},
        {"rerank": {"enabled": True, "checkpoint": {"existingClaim": "celi"}}},
    ):
        after = _pod_template(render(chart, {**base, **change}), "Deployment", "triton")
        assert after == before, change
    # ...while what Triton reads does restart it
    other = _pod_template(
        render(chart, {"encoder": {"flavor": flavor, "size": "large"}}), "Deployment", "triton"
    )
    key = "checksum/config"
    assert other["metadata"]["annotations"][key] != before["metadata"]["annotations"][key]


def test_tritons_checksum_is_its_configmaps(chart: Any) -> None:
    """The annotation hashes the Triton ConfigMap as rendered, nothing else: changing the
    gateway's ConfigMap (another shard count) changes the gateway's checksum only."""
    one = render(chart, {"index": {"shards": 1}})
    four = render(chart, {"index": {"shards": 4}})
    key = "checksum/config"
    gateway = [_pod_template(d, "Deployment", "gateway") for d in (one, four)]
    assert gateway[0]["metadata"]["annotations"][key] != gateway[1]["metadata"]["annotations"][key]
    triton = [_pod_template(d, "Deployment", "triton") for d in (one, four)]
    assert triton[0]["metadata"]["annotations"][key] == triton[1]["metadata"]["annotations"][key]
    assert [d for d in of_kind(one, "ConfigMap") if d["metadata"]["name"].endswith("-triton")]


# --- item 4: defaults a plain managed GPU cluster can install -------------------------

# GPU everywhere it can be: Triton's gpu flavour (the default), GPU shards, GPU rerank.
ALL_GPU: dict[str, Any] = {
    "encoder": {"flavor": "gpu", "size": "xl"},
    "index": {"gpu": {"enabled": True}},
    "rerank": {"enabled": True, "gpu": True, "checkpoint": {"existingClaim": "celi"}},
}


def _pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pod spec by workload name."""
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet", "Job")
    }


def _gpu_pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        name: pod
        for name, pod in _pods(docs).items()
        if any(
            "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
            for c in pod["containers"] + pod.get("initContainers", [])
        )
    }


def test_the_defaults_need_no_rwx_storage_no_gfd_label_and_request_gpus(chart: Any) -> None:
    docs = render(chart, ALL_GPU)
    for doc in docs:
        validate(doc)
    claims = of_kind(docs, "PersistentVolumeClaim") + [
        t for d in of_kind(docs, "StatefulSet") for t in d["spec"].get("volumeClaimTemplates", [])
    ]
    assert claims and all("ReadWriteMany" not in c["spec"]["accessModes"] for c in claims)
    gpu = _gpu_pods(docs)
    names = {n.split("-gtr-retrieval-")[1] for n in gpu}
    assert names == {"triton", "shard-0", "shard-1", "rerank"}
    for name, pod in gpu.items():
        assert "nvidia.com/gpu.present" not in pod.get("nodeSelector", {}), name
        taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        assert taint in pod["tolerations"], name
        assert "runtimeClassName" not in pod, name
        for c in pod["containers"]:
            assert c["resources"]["requests"]["nvidia.com/gpu"] >= 1, (name, c["name"])
    plans = {v["name"]: v for v in _pods(docs)["gtr-gtr-retrieval-triton"]["volumes"]}["plans"]
    assert plans["emptyDir"]["sizeLimit"]  # per pod, sized (was: an RWX claim, Pending)


def test_runtime_class_and_gfd_label_are_values(chart: Any) -> None:
    values = {
        **ALL_GPU,
        "gpu": {"resourceName": "nvidia.com/gpu", "runtimeClassName": "nvidia"},
        "encoder": {**ALL_GPU["encoder"], "gpuNodeSelector": {"nvidia.com/gpu.present": "true"}},
    }
    docs = render(chart, values)
    for doc in docs:
        validate(doc)
    gpu = _gpu_pods(docs)
    assert all(pod["runtimeClassName"] == "nvidia" for pod in gpu.values())
    cpu = {n: p for n, p in _pods(docs).items() if n not in gpu}
    assert cpu and not any("runtimeClassName" in p for p in cpu.values())
    triton = _pods(docs)["gtr-gtr-retrieval-triton"]
    assert triton["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_affinity_is_a_value_merged_with_the_charts_spreading(chart: Any) -> None:
    zone = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "cloud.google.com/gke-accelerator", "operator": "Exists"}
                        ]
                    }
                ]
            }
        }
    }
    values = {
        "encoder": {"affinity": zone},
        "index": {"affinity": zone},
        "rerank": {"enabled": True, "checkpoint": {"existingClaim": "c"}, "affinity": zone},
    }
    docs = render(chart, values)
    for doc in docs:
        validate(doc)
    pods = _pods(docs)
    for name in ("triton", "shard-0", "rerank"):
        affinity = pods[f"gtr-gtr-retrieval-{name}"]["affinity"]
        assert affinity["nodeAffinity"] == zone["nodeAffinity"], name
        assert "preferredDuringSchedulingIgnoredDuringExecution" in affinity["podAntiAffinity"]
    mine: dict[str, Any] = {
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}
    }
    triton = _pods(render(chart, {"encoder": {"affinity": mine}}))["gtr-gtr-retrieval-triton"]
    assert triton["affinity"] == mine


@pytest.mark.parametrize(
    "values",
    [
        {"gpu": {"resourceName": "nvidia.com/gpu", "runtimeClassName": 1}},
        {"encoder": {"affinity": {"nodeAfinity": {}}}},
        {"index": {"affinity": []}},
    ],
)
def test_the_schema_checks_the_new_values(chart: Any, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(chart, values)


# --- item 5: the plan must fit the disk the pod has ------------------------------------


@pytest.mark.parametrize(("size", "storage"), [("base", 2**30), ("xl", 4 * 2**30)])
def test_the_plan_build_is_told_its_disk(chart: Any, size: str, storage: int) -> None:
    """ensure-plan gets planStorage as --max-plan-bytes, so an FP32 fallback that cannot
    fit /models (xl ~4.9 GB in 4Gi) is refused with the setting's name, not evicted."""
    from services.cli.main import build_parser

    docs = render(chart, {"encoder": {"flavor": "gpu", "size": size}})
    (build,) = _pods(docs)["gtr-gtr-retrieval-triton"]["initContainers"]
    args = build_parser().parse_args(build["args"])
    assert args.max_plan_bytes == storage
