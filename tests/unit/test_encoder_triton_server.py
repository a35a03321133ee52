"""How tritonserver is started from the nvidia-pytriton wheel (command and environment)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from services.encoder.serve.triton_server import (
    TritonServerConfig,
    prepare_backend_dir,
    pytriton_root,
    triton_command,
)


@pytest.fixture(scope="module")
def wheel() -> Path:
    return pytriton_root()


def test_backend_dir_holds_this_pythons_stub(wheel: Path, tmp_path: Path) -> None:
    backend = prepare_backend_dir(tmp_path) / "python"
    names = sorted(p.name for p in backend.iterdir())
    assert names == [
        "libtriton_python.so",
        "triton_python_backend_stub",
        "triton_python_backend_utils.py",
    ]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel / "python_backend_stubs" / version / "triton_python_backend_stub"
    assert (backend / "triton_python_backend_stub").read_bytes() == stub.read_bytes()
    assert os.access(backend / "triton_python_backend_stub", os.X_OK)
    prepare_backend_dir(tmp_path)  # idempotent


def test_command_and_environment(wheel: Path, tmp_path: Path) -> None:
    cfg = TritonServerConfig(
        tmp_path / "repo", grpc_port=1, http_port=2, metrics_port=3, backend_dir=tmp_path / "b"
    )
    argv, env = triton_command(cfg)
    assert argv[0] == str(wheel / "bin" / "tritonserver")
    assert f"--model-repository={(tmp_path / 'repo').resolve()}" in argv
    assert f"--backend-directory={tmp_path / 'b'}" in argv
    assert {"--grpc-port=1", "--http-port=2", "--metrics-port=3"} <= set(argv)
    # explicit model control, every model loaded at start: encoder publish loads versions
    assert {"--model-control-mode=explicit", "--load-model=*"} <= set(argv)
    libs = env["LD_LIBRARY_PATH"].split(":")
    assert libs[0] == str(Path(sys.base_prefix) / "lib")  # this interpreter's libpython first
    assert libs[1].endswith("nvidia_pytriton.libs")
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)  # the venv's python3
    assert env.get("HOME") == os.environ.get("HOME")  # the rest of the environment is kept
