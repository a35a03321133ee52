"""The gateway process loads what it uses: not the shard core, not the text index.

A fresh interpreter imports the gateway's server and what its start imports inside its
functions (``services/gateway/server.py``: the Triton encoder, the store connection and
layout check, the router, the change-log writer, the document and log-tail readers), then
lists its modules. The shard core (``services.index.core.shard``: the GPU code, the slots,
the trained index) and the text index (``services.index.core.text`` and tantivy) serve
shards only; a gateway that loads them pays their import time and memory in every replica
for nothing. faiss stays: the router's shared coarse quantizer uses it
(docs/architecture.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

GATEWAY = (
    "services.gateway.server",
    "services.encoder.runtime.triton_client",
    "services.index.client.connection",
    "services.index.client.router",
    "services.index.client.writer",
    "services.index.client.documents",
    "services.index.client.tails",
    "services.index.layout",
)
NOT_IN_THE_GATEWAY = ("tantivy", "services.index.core.shard", "services.index.core.text")


def loaded_by(modules: tuple[str, ...]) -> set[str]:
    """The modules a new interpreter holds after importing ``modules``."""
    code = (
        f"import importlib, sys\nfor m in {list(modules)!r}:\n    importlib.import_module(m)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert run.returncode == 0, run.stderr
    return set(run.stdout.split())


def test_the_gateway_loads_neither_the_shard_core_nor_tantivy() -> None:
    loaded = loaded_by(GATEWAY)
    assert "services.gateway.server" in loaded  # the listing is of the right process
    found = sorted(
        m
        for m in loaded
        if any(m == name or m.startswith(name + ".") for name in NOT_IN_THE_GATEWAY)
    )
    assert found == [], f"the gateway loads {found}"
    assert "faiss" in loaded  # the shared coarse quantizer: on purpose
