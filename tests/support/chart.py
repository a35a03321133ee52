"""The Helm chart in deploy/k8s/gtr-retrieval rendered offline with helm-python-sdk, for
the chart's tests (tests/unit/test_deploy_chart*.py, test_deploy_redis_rules.py): the
module-scoped ``chart`` fixture, ``render`` and the lookups on its manifests, strict
Kubernetes schema validation, helm lint, and checkov on them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed"
)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "k8s" / "gtr-retrieval"
PREPARE_SCRIPT = CHART / "files" / "prepare_model_repository.py"

KUBE_VERSION = "1.33.0"
RELEASE = "gtr"
NAMESPACE = "search"

# checkov findings the chart suppresses on purpose; each carries its reason in a
# checkov.io/skip annotation.
ALLOWED_SKIPS = {"CKV_K8S_43", "CKV_K8S_15", "CKV_K8S_35"}

Manifest = dict[str, Any]


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


# The chart requires bearer tokens by default (it does not render without them): every
# render here names a token Secret unless its values say something of auth themselves.
TOKENS_SECRET = {"auth": {"enabled": True, "existingSecret": "gtr-tokens"}}


def with_auth(values: dict[str, Any] | None) -> dict[str, Any]:
    return {**TOKENS_SECRET, **(values or {})}


def render(chart: Any, values: dict[str, Any] | None = None) -> list[Manifest]:
    """Render the chart and parse every manifest (NOTES.txt and empty templates skipped)."""
    rendered: dict[str, str] = chart.render(with_auth(values), name=RELEASE, namespace=NAMESPACE)
    docs: list[Manifest] = []
    for path, text in sorted(rendered.items()):
        if not path.endswith(".yaml"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def render_as_given(chart: Any, values: dict[str, Any] | None) -> dict[str, str]:
    """The chart rendered with exactly ``values`` (no token Secret added, nothing parsed):
    for the errors that values raise (helm.HelmValuesError, helm.HelmRenderError)."""
    rendered: dict[str, str] = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return rendered


def validate(doc: Manifest) -> None:
    """Validate one manifest against the Kubernetes schemas of ``KUBE_VERSION``, strictly
    (an unknown field fails): kubernetes_validate.ValidationError when it does not hold."""
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def lint_findings(values: dict[str, Any] | None) -> list[Any]:
    """``helm lint --strict`` of the chart with ``values`` (and a token Secret, as
    :func:`render`) for ``KUBE_VERSION`` in ``NAMESPACE``: its errors and every message
    of warning severity or worse (none for a clean chart)."""
    report = helm.lint(
        CHART,
        with_auth(values),
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{KUBE_VERSION}",
    )
    return [*report["errors"], *(m for m in report["messages"] if m["severity"] >= 2)]


def of_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind]


def component(doc: Manifest) -> str:
    return str(doc["metadata"]["labels"].get("app.kubernetes.io/component", ""))


def workloads(docs: list[Manifest]) -> list[Manifest]:
    return [d for d in docs if d["kind"] in {"Deployment", "StatefulSet"}]


def the(docs: list[Manifest], kind: str, comp: str) -> Manifest:
    found = [d for d in of_kind(docs, kind) if component(d) == comp]
    assert len(found) == 1, f"expected one {kind} of {comp}, found {len(found)}"
    return found[0]


def configmap_data(docs: list[Manifest], suffix: str) -> dict[str, str]:
    name = f"{RELEASE}-gtr-retrieval-{suffix}"
    for doc in of_kind(docs, "ConfigMap"):
        if doc["metadata"]["name"] == name:
            data: dict[str, str] = doc["data"]
            return data
    raise AssertionError(f"no ConfigMap {name}")


# --- checkov ------------------------------------------------------------------------------


def find_checkov() -> str | None:
    # scripts/bootstrap.sh installs checkov into a venv of its own (its pins clash with ours)
    for candidate in (
        ROOT / ".venv" / "tools" / "checkov" / "bin" / "checkov",
        Path(sys.executable).parent / "checkov",
    ):
        if candidate.exists():
            return str(candidate)
    return shutil.which("checkov")


def checkov_manifests(docs: list[Manifest]) -> list[Manifest]:
    """What checkov is given: the manifests without the Prometheus Operator's kinds."""
    return [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]


def run_checkov(docs: list[Manifest], tmp_path: Path) -> dict[str, Any]:
    """checkov (kubernetes framework) on :func:`checkov_manifests` of ``docs``: fails the
    test when a check fails or a check is skipped that ``ALLOWED_SKIPS`` does not allow,
    and when checkov is missing (scripts/bootstrap.sh installs it, as CI runs it).
    Returns the report's ``results``."""
    checkov = find_checkov()
    if checkov is None:
        pytest.fail("checkov is not installed: scripts/bootstrap.sh installs it")
    manifests = checkov_manifests(docs)
    (tmp_path / "manifests.yaml").write_text(yaml.safe_dump_all(manifests), encoding="utf-8")
    done = subprocess.run(
        [
            checkov,
            "-d",
            str(tmp_path),
            "--framework",
            "kubernetes",
            "--skip-download",
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    report = json.loads(done.stdout)
    report = report[0] if isinstance(report, list) else report
    results: dict[str, Any] = report["results"]
    failed = [(c["check_id"], c["resource"]) for c in results["failed_checks"]]
    assert failed == [], failed
    skipped = {c["check_id"] for c in results["skipped_checks"]}
    assert skipped <= ALLOWED_SKIPS, skipped - ALLOWED_SKIPS
    return results
