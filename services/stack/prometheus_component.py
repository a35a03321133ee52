"""How the local stack runs Prometheus (when installed): the repository's config and SLO
rules, and a file of targets kept in step with the children."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from services.process.private import make_private
from services.stack.children import Child, free_port
from services.stack.config import StackConfig

PROMETHEUS_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def prometheus_child(cfg: StackConfig, children: list[Child]) -> Child | None:
    """Prometheus scraping every child, with the SLO rules; None when not installed."""
    binary = shutil.which("prometheus")
    if binary is None or not (PROMETHEUS_CONFIG / "prometheus.yml").exists():
        return None
    home = cfg.run_dir / "prometheus"
    home.mkdir(parents=True, exist_ok=True)
    for name in ("prometheus.yml", "rules.yml"):
        shutil.copy2(PROMETHEUS_CONFIG / name, home / name)
    make_private(home)  # the copies kept the sources' 0644
    write_prometheus_targets(cfg, children)
    port = free_port(cfg.host)
    argv = [
        binary,
        f"--config.file={(home / 'prometheus.yml').resolve()}",
        f"--storage.tsdb.path={(home / 'data').resolve()}",
        f"--web.listen-address={cfg.host}:{port}",
    ]
    child = Child("prometheus", argv, cfg.logs / "prometheus.log")
    child.address = f"{cfg.host}:{port}"
    return child


def write_prometheus_targets(cfg: StackConfig, children: Sequence[Child]) -> None:
    """Prometheus's ``targets.json`` (file_sd: re-read on change, no restart): every
    child with a metrics endpoint; rewritten when a generation's shards start or stop."""
    import json

    home = cfg.run_dir / "prometheus"
    if not home.is_dir():
        return
    targets = [
        {"targets": [c.metrics], "labels": {"job": c.job, "instance": c.name}}
        for c in children
        if c.metrics and c.job
    ]
    tmp = home / "targets.json.tmp"
    tmp.write_text(json.dumps(targets, indent=2), encoding="utf-8")
    tmp.replace(home / "targets.json")
