"""``pip install clients/python`` in a fresh virtualenv, as a user does it: the SDK and
the generated wire contract install with grpcio and protobuf (and protobuf's
googleapis-common-protos) and nothing of the server's (torch, faiss, Triton, ONNX
Runtime), import without the checkout on the path, and ship their type information.

Needs the package index (PyPI, through pip's own cache); skipped, saying so, when it
cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the SDK may bring: its own distribution, its three dependencies (and grpcio's own,
# typing-extensions), and what a fresh virtualenv starts with.
ALLOWED = {
    "gtr-retrieval-client",
    "grpcio",
    "typing-extensions",
    "protobuf",
    "googleapis-common-protos",
}
VENV_OWN = {"pip", "setuptools"}
SERVER = {
    "torch",
    "faiss-cpu",
    "faiss-gpu",
    "nvidia-pytriton",
    "tritonclient",
    "tritonserver",
    "onnxruntime",
    "onnxruntime-gpu",
    "gtr-retrieval",
}


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


@pytest.mark.slow
def test_the_sdk_installs_alone_in_a_clean_virtualenv(tmp_path: Path) -> None:
    # a copy: pip builds in the source tree (build/, *.egg-info), not in the checkout's
    src = tmp_path / "gtr-retrieval-client"
    shutil.copytree(
        ROOT / "clients" / "python",
        src,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    try:
        install = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", str(src)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.skip("pip could not install within 300 s (package index slow or unreachable)")
    if install.returncode != 0:
        out = install.stdout + install.stderr
        if re.search(r"Could not find a version|NewConnectionError|Temporary failure", out):
            pytest.skip(f"pip could not reach a package index: {out[-300:]}")
        pytest.fail(f"pip install clients/python failed:\n{out[-3000:]}")

    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    installed = {_name(d["name"]) for d in json.loads(listed.stdout)}
    assert not installed & SERVER, f"the server's packages came with the SDK: {installed & SERVER}"
    assert installed - VENV_OWN == ALLOWED, installed

    probe = (
        "import sys, gtr_client, retrieval\n"
        "from retrieval.v1 import search_pb2_grpc, documents_pb2_grpc, index_pb2_grpc\n"
        "from gtr_client import Client, AsyncClient\n"
        "assert not {'torch', 'faiss', 'services', 'numpy'} & set(sys.modules), sys.modules\n"
        "print(gtr_client.__version__, gtr_client.__file__, retrieval.__file__)\n"
    )
    imported = subprocess.run(
        [str(python), "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert imported.returncode == 0, imported.stderr
    version, sdk_file, contract_file = imported.stdout.split()
    site = venv / "lib"
    assert Path(sdk_file).is_relative_to(site) and Path(contract_file).is_relative_to(site)
    contract = (ROOT / "protos" / "VERSION").read_text().strip()
    assert version == contract
    packages = Path(sdk_file).parent.parent
    for typed in ("gtr_client/py.typed", "retrieval/py.typed", "retrieval/v1/search_pb2.pyi"):
        assert (packages / typed).is_file(), typed
