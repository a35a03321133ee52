"""services/rpc/auth.py without a server: token files as operators write them (and
as the kubelet rotates them), the scope table, the bearer header, and what an error
message may say. The same checks over gRPC: tests/integration/test_auth_tls.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common import errors
from services.rpc.auth import (
    METHOD_SCOPES,
    Authenticator,
    Scope,
    TokenFile,
    bearer_token,
    parse_tokens,
    scope_of,
)

READ, WRITE = "read-token-aaaaaaaaaaaa", "write-token-bbbbbbbbbbbb"


def test_token_files_take_one_token_per_line_without_blanks_or_comments() -> None:
    text = f"# readers\n\n  {READ}  \n{WRITE} # the loader\n#{READ}x\n"
    assert parse_tokens(text) == [READ, WRITE]


def test_the_scope_table_covers_the_public_api_and_leaves_probes_open() -> None:
    assert {m.rsplit("/", 1)[-1] for m, s in METHOD_SCOPES.items() if s is Scope.READ} == {
        "Search",
        "BatchSearch",
        "Get",
    }
    assert scope_of("/retrieval.v1.DocumentService/Upsert") is Scope.WRITE
    assert scope_of("/grpc.health.v1.Health/Check") is None
    assert scope_of("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") is None
    # a method nobody put in the table needs the most, not nothing
    assert scope_of("/retrieval.v1.DocumentService/Truncate") is Scope.WRITE


def _files(tmp_path: Path) -> tuple[Path, Path]:
    read, write = tmp_path / "read", tmp_path / "write"
    read.write_text(f"{READ}\n")
    write.write_text(f"{WRITE}\n")
    return read, write


def test_scopes_missing_and_wrong_tokens(tmp_path: Path) -> None:
    read, write = _files(tmp_path)
    auth = Authenticator.from_files(str(read), str(write))
    search, upsert = "/retrieval.v1.SearchService/Search", "/retrieval.v1.DocumentService/Upsert"
    auth.check(search, [("authorization", f"Bearer {READ}")])
    auth.check(search, [("authorization", f"bearer {WRITE}")])  # the scheme is case-blind
    auth.check(upsert, [("authorization", f"Bearer {WRITE}")])
    with pytest.raises(errors.PermissionDenied) as denied:
        auth.check(upsert, [("authorization", f"Bearer {READ}")])
    assert READ not in denied.value.message
    for metadata in ([], [("authorization", "Bearer nope")], [("authorization", READ)]):
        with pytest.raises(errors.Unauthenticated) as refused:
            auth.check(search, metadata)
        assert READ not in refused.value.message and "nope" not in refused.value.message
    auth.check("/grpc.health.v1.Health/Check", [])


def test_a_missing_or_empty_token_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no token"):
        (tmp_path / "empty").write_text("# nothing yet\n")
        TokenFile(tmp_path / "empty").load()
    with pytest.raises(ValueError, match="No such file"):
        TokenFile(tmp_path / "absent").load()
    with pytest.raises(ValueError, match="no token file"):
        Authenticator.from_files(None, None)


def test_a_rotated_file_is_reread_and_an_emptied_one_keeps_its_tokens(tmp_path: Path) -> None:
    path = tmp_path / "read"
    path.write_text(f"{READ}\n")
    tokens = TokenFile(path, reload_interval_s=0).load()
    before = tokens.current()
    # the kubelet's way: a new file renamed over the old one
    fresh = tmp_path / "read.new"
    fresh.write_text(f"{WRITE}\n")
    fresh.replace(path)
    after = tokens.current()
    assert after != before and len(after) == 1
    # half-written (empty) or gone: the previous tokens stay
    path.write_text("")
    assert tokens.current() == after
    os.remove(path)
    assert tokens.current() == after


def test_bearer_header_forms() -> None:
    assert bearer_token([("authorization", b"Bearer abc")]) == "abc"
    assert bearer_token([("x-other", "1"), ("Authorization", "Bearer  abc ")]) == "abc"
    with pytest.raises(errors.Unauthenticated):
        bearer_token([("authorization", "Bearer ")])
