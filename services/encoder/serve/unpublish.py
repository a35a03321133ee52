"""Take a version of ``embed`` out again: ``encoder unpublish``, ``index retire`` (issue #24).

:func:`unpublish_version` takes a version out again (an encoder no generation uses any
more: its memory in Triton is freed); the last one stays. ``index retire`` calls it for
the retired generation's version once no generation uses it
(:func:`services.generations.encoders.generations_using`, the policy) (``encoder
unpublish`` is the same call by hand), asked under the repository's publish lock
(``in_use``): ``index rollout --encoder`` takes the rollout lock (phase ``publish``)
before it publishes, so an unpublish either sees that rollout or ends before its publish
looks for the same export.

The repository's side (lock, staging, conversion) is :mod:`services.encoder.serve.versions`;
the loads :mod:`services.encoder.serve.triton_load`.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.errors import FailedPrecondition, NotFound, RetrievalError
from services.encoder.base import version_key
from services.encoder.build.repository import EMBED_MODEL, read_config
from services.encoder.serve.triton_load import LOAD_TIMEOUT_S, load_everywhere
from services.encoder.serve.versions import (
    convert_older,
    drop_stale_staging,
    locked,
    served_versions,
    write_atomically,
)
from services.process.cpus import budget_path

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS


def unpublish_version(
    repo_dir: Path,
    version: int,
    triton_url: str | None = None,
    *,
    tls: ClientTLS | None = None,
    load_timeout_s: float = LOAD_TIMEOUT_S,
    in_use: Callable[[], list[str]] | None = None,
) -> None:
    """Take version ``version`` of ``embed`` out of the repository and, with
    ``triton_url``, out of those Tritons (they load ``embed`` again without it).

    For an encoder no generation uses any more (``index retire``): its memory in every
    Triton is freed. NotFound for a version that is not there; FailedPrecondition for the
    last one (``embed`` would serve nothing); :class:`VersionInUse`, nothing changed, when
    ``in_use`` (asked under the publish lock: no publish runs meanwhile) names who still
    uses it. A failed load puts it back."""
    repo = Path(repo_dir)
    model_path = repo / EMBED_MODEL
    config_path = model_path / "config.pbtxt"
    if not config_path.exists():
        raise FailedPrecondition(f"{repo} has no {EMBED_MODEL} model")
    with locked(model_path):
        # An unpublish stopped before its folder went (the policy still `specific`, the
        # folder perhaps half deleted) is finished first: its folder would otherwise be
        # taken for a version, and put back into the policy.
        converted = convert_older(model_path, read_config(config_path))
        if converted is not None:
            write_atomically(config_path, converted)
        versions = served_versions(repo)
        if version not in versions:
            raise NotFound(f"{model_path} has no version {version} (versions: {versions})")
        users = in_use() if in_use is not None else []
        if users:
            raise VersionInUse(version, users)
        if versions == [version]:
            raise FailedPrecondition(
                f"version {version} is the only version of {model_path}: it stays"
            )
        drop_stale_staging(model_path)
        old_text = config_path.read_text()
        config = read_config(config_path)
        prefix = version_key(version, "")  # an older generator's parameters of it
        for key in [k for k in config.parameters if k.startswith(prefix)]:
            del config.parameters[key]
        from google.protobuf import text_format

        # Out of Triton's sight through the version policy (a change Triton does not
        # reload the other versions for, unlike a folder moved aside inside the model
        # folder: a non-version entry newer than their load), then the load; the folder
        # goes once Triton no longer runs it, and the policy is `all` again.
        policy = config.version_policy
        policy.specific.versions[:] = [v for v in versions if v != version]
        write_atomically(config_path, text_format.MessageToString(config))
        if triton_url:
            try:
                load_everywhere(triton_url, None, tls, load_timeout_s)
            except BaseException:
                write_atomically(config_path, old_text)
                with contextlib.suppress(RetrievalError):
                    load_everywhere(triton_url, None, tls, load_timeout_s)
                raise
        shutil.rmtree(model_path / str(version))
        Path(budget_path(str(model_path / str(version)))).unlink(missing_ok=True)
        policy.all.SetInParent()
        write_atomically(config_path, text_format.MessageToString(config))


class VersionInUse(FailedPrecondition):
    """:func:`unpublish_version` refused: ``users`` (generations, a rollout) use it."""

    def __init__(self, version: int, users: list[str]) -> None:
        super().__init__(f"embed version {version} is the encoder of {', '.join(users)}")
        self.version = version
        self.users = users
