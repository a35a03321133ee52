"""The chart's GPU parts (issue #37): what restarts the GPU Triton pods (item 6), and
defaults that install on a plain managed GPU cluster (item 4): no ReadWriteMany volume,
no label only GPU Feature Discovery sets, GPUs requested and their taint tolerated, and
runtimeClassName / affinity as values. Rendered offline with helm-python-sdk and validated
with kubernetes-validate, as in test_deploy_chart.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.chart import chart, of_kind, render, the

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
