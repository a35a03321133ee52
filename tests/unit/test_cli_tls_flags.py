"""Half a client key pair on the command line (issue #24 follow-up): every command that
takes ``--triton-client-cert/--triton-client-key`` (Triton) or ``--tls-client-cert/
--tls-client-key`` (the shard replicas) refuses a certificate without its key, or a key
without its certificate, with one line naming both flags and exit status 2, before it
reaches for anything (the store's address here answers nothing). It used to end in a
ValueError traceback naming the shard flags (with --triton-ca), or to be ignored and fail
later at Redis (without it). Driven as an operator runs it: ``python -m
services.cli.main`` as a subprocess, with real PEM files of a throwaway CA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.stack.certs import CertFiles, make_certs
from tests.support.processes import pythonpath
from tests.support.shards import ROOT

NOWHERE = "redis://127.0.0.1:1/0"  # nothing listens: a command that got this far fails


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(tmp_path_factory.mktemp("half-pair"))


def refusal(argv: list[str], cwd: Path) -> str:
    """Run the CLI with ``argv`` in ``cwd`` (no local stack: it has no .run; an encoder
    command's repository in it) as an operator would; assert it refused with exit status
    2, one line on stderr and no traceback; → that line."""
    if argv[0] == "encoder":
        argv = [*argv, "--repo", str(cwd)]
    run = subprocess.run(
        [sys.executable, "-m", "services.cli.main", *argv],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


# (command, the flags' prefix, the half given, whether --<prefix>-ca goes with it)
ROLLOUT = ["index", "rollout", "--retrain", "--redis-url", NOWHERE, "--yes"]
CASES = [
    (ROLLOUT, "triton", "cert", True),
    (ROLLOUT, "triton", "key", False),
    (["index", "rollback", "--redis-url", NOWHERE, "--yes"], "triton", "key", True),
    (["index", "retire", "--redis-url", NOWHERE, "--yes"], "triton", "cert", True),
    (["encoder", "unpublish", "--version", "2", "--redis-url", NOWHERE], "triton", "key", True),
    (["encoder", "publish", "--model-dir", "no-such-model"], "triton", "cert", False),
    (ROLLOUT, "tls", "cert", True),
    (["index", "stats", "127.0.0.1:1"], "tls", "key", True),
    (["index", "snapshot", "127.0.0.1:1"], "tls", "cert", False),
]


@pytest.mark.parametrize(("command", "prefix", "half", "with_ca"), CASES)
def test_half_a_client_key_pair_is_refused_naming_both_flags(
    certs: CertFiles, tmp_path: Path, command: list[str], prefix: str, half: str, with_ca: bool
) -> None:
    given = {"cert": certs.client_cert, "key": certs.client_key}[half]
    argv = [*command, f"--{prefix}-client-{half}", str(given)]
    if with_ca:
        argv += [f"--{prefix}-ca", str(certs.ca)]
    line = refusal(argv, tmp_path)
    assert f"--{prefix}-client-cert" in line and f"--{prefix}-client-key" in line
    assert line.startswith("error: ")


# Commands that reach Triton, given a whole client key pair for it but no --triton-ca (and
# no local stack whose CA would be taken): the CLI talks TLS to Triton only with a CA, so the
# pair used to be dropped without a word and Triton reached in plaintext.
WITHOUT_CA = [
    ["index", "rollout", "--encoder", "no-such-model", "--redis-url", NOWHERE, "--yes"],
    ["index", "rollback", "--redis-url", NOWHERE, "--yes"],
    ["index", "retire", "--redis-url", NOWHERE, "--yes"],
    ["encoder", "publish", "--model-dir", "no-such-model", "--triton-url", "127.0.0.1:1"],
    ["encoder", "unpublish", "--version", "2", "--redis-url", NOWHERE],
]


@pytest.mark.parametrize("command", WITHOUT_CA, ids=lambda c: " ".join(c[:2]))
def test_a_triton_client_key_pair_without_a_ca_is_refused_naming_triton_ca(
    certs: CertFiles, tmp_path: Path, command: list[str]
) -> None:
    argv = [
        *command,
        "--triton-client-cert",
        str(certs.client_cert),
        "--triton-client-key",
        str(certs.client_key),
    ]
    line = refusal(argv, tmp_path)
    assert line.startswith("error: ") and "--triton-ca" in line, line
    assert "--triton-client-cert" in line


def test_triton_tls_takes_each_missing_file_from_the_local_stack(
    certs: CertFiles, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One rule for every command that reaches Triton (encoder publish/unpublish/versions
    and index rollout/rollback/retire): a flag given wins, each file not given comes from
    the stack's internal TLS; so --triton-ca alone on an mTLS stack still presents the
    stack's client certificate."""
    from services.cli.common import triton_tls

    own = make_certs(tmp_path_factory.mktemp("own-ca"))
    stack = {"ca": str(certs.ca), "cert": str(certs.client_cert), "key": str(certs.client_key)}
    assert triton_tls(None, None, None) is None
    everything = triton_tls(None, None, None, stack)
    assert (everything.ca, everything.cert, everything.key) == (
        str(certs.ca),
        str(certs.client_cert),
        str(certs.client_key),
    )
    ca_only = triton_tls(str(own.ca), None, None, stack)
    assert (ca_only.ca, ca_only.cert) == (str(own.ca), str(certs.client_cert))
    pair = triton_tls(None, str(own.client_cert), str(own.client_key), stack)
    assert (pair.ca, pair.cert, pair.key) == (
        str(certs.ca),
        str(own.client_cert),
        str(own.client_key),
    )
