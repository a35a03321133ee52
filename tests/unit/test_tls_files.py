"""PEM files are read once and again only when they change on disk
(services/rpc/tls.py read_pem): many channels built from one ClientTLS cost one read
of each file, and a file replaced on disk (a rotated Secret) is read again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from services.rpc import tls as tls_module
from services.rpc.tls import ClientTLS, file_version, read_pem
from services.stack.certs import make_certs


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The PEM files read from disk (Path.read_bytes, spied on, still reading)."""
    seen: list[Path] = []
    read_bytes = Path.read_bytes

    def spy(self: Path) -> bytes:
        seen.append(self)
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", spy)
    monkeypatch.setattr(tls_module, "_pem_cache", {})
    return seen


def test_channels_from_one_configuration_read_each_file_once(
    tmp_path: Path, reads: list[Path]
) -> None:
    certs = make_certs(tmp_path / "certs")
    tls = ClientTLS(certs.ca, certs.client_cert, certs.client_key)
    for _ in range(20):
        tls.credentials()
    assert sorted(reads) == sorted([certs.ca, certs.client_cert, certs.client_key])


def test_a_file_replaced_on_disk_is_read_again(tmp_path: Path, reads: list[Path]) -> None:
    one, two = make_certs(tmp_path / "one"), make_certs(tmp_path / "two", common_name="two")
    live = tmp_path / "ca.pem"
    shutil.copyfile(one.ca, live)
    assert read_pem(live, "CA") == one.ca.read_bytes()
    before = file_version(live)
    tmp = tmp_path / "ca.pem.new"
    shutil.copyfile(two.ca, tmp)
    os.replace(tmp, live)  # as a Secret volume swaps its files
    assert file_version(live) != before
    assert read_pem(live, "CA") == two.ca.read_bytes()
    assert read_pem(live, "CA") == two.ca.read_bytes()
    assert reads.count(live) == 2


def test_a_file_that_is_gone_is_an_error_not_the_cached_bytes(
    tmp_path: Path, reads: list[Path]
) -> None:
    certs = make_certs(tmp_path / "certs")
    read_pem(certs.ca, "TLS CA")
    certs.ca.unlink()
    with pytest.raises(ValueError, match="TLS CA"):
        read_pem(certs.ca, "TLS CA")


def test_a_client_key_of_another_certificate_is_refused(tmp_path: Path) -> None:
    one, two = make_certs(tmp_path / "one"), make_certs(tmp_path / "two", common_name="two")
    with pytest.raises(ValueError, match="do not match"):
        ClientTLS(one.ca, one.client_cert, two.client_key).check()
