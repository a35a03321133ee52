"""Which encoder versions stay published: the policy over Triton's ``embed`` versions.

The mechanics (publish, unpublish, the repository's lock) are the encoder's
(:mod:`services.encoder.serve.publish`, :mod:`~services.encoder.serve.unpublish`,
:mod:`~services.encoder.serve.versions`); which versions generations still use is known
here, from the registry. A version stays published while a generation in a running state
uses it (its shards run, it may serve again) or the recorded rollout will; ``index
retire`` releases the retired generation's version through :func:`release_encoder`, and
``encoder unpublish`` asks :func:`in_use` under the repository's publish lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from services.common.errors import NotFound, RetrievalError
from services.encoder.serve.unpublish import VersionInUse, unpublish_version
from services.generations.registry import RUNNING, Generation, Registry
from services.generations.state import RolloutState

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS


def generations_using(
    generations: Iterable[Generation],
    version: int,
    rollout: RolloutState | None = None,
) -> list[str]:
    """The generations in a running state whose encoder is ``version`` of ``embed`` (a
    record without a version means version 1), and the target of the recorded
    ``rollout`` when its plan names ``version`` (the builder takes the lock before it
    writes the target's record) or when it is still publishing its encoder (phase
    ``publish``: the version is not known yet, and may be this one, an export published
    before)."""
    names = [
        g.name for g in generations if g.state in RUNNING and (g.encoder.version or 1) == version
    ]
    if rollout is not None:
        planned = rollout.plan.encoder if rollout.plan is not None else None
        publishing = rollout.phase == "publish"
        using = publishing or (planned is not None and (planned.version or 1) == version)
        if using and rollout.target not in names:
            names.append(
                f"{rollout.target} (a rollout publishing its encoder)"
                if publishing
                else rollout.target
            )
    return names


def in_use(registry: Registry, version: int) -> Callable[[], list[str]]:
    """The question :func:`~services.encoder.serve.unpublish.unpublish_version` asks under
    the publish lock: who uses ``version`` now."""
    return lambda: generations_using(registry.all(), version, registry.running())


Outcome = Literal["kept", "no_repository", "absent", "failed", "unpublished"]


@dataclass(frozen=True)
class Release:
    """What became of a retired generation's encoder version: ``kept`` (``users`` still
    use it), ``no_repository`` (unused, but no repository was named to remove it from),
    ``absent`` (not in the repository), ``failed`` (``error``: Triton unreachable or
    refusing; the repository as it was) or ``unpublished``."""

    version: int
    outcome: Outcome
    users: tuple[str, ...] = ()
    error: RetrievalError | None = None


def release_encoder(
    registry: Registry,
    gen: Generation,
    repo: Path | None,
    triton_url: str | None = None,
    tls: ClientTLS | None = None,
) -> Release:
    """Unpublish ``gen``'s version of ``embed`` when no generation in a running state
    (nor the recorded rollout's target) uses it; asked again under the publish lock, as a
    rollout may have begun publishing meanwhile."""

    version = gen.encoder.version or 1  # a record without a version: version 1
    using = in_use(registry, version)
    users = using()
    if users:
        return Release(version, "kept", tuple(users))
    if repo is None:
        return Release(version, "no_repository")
    try:
        unpublish_version(repo, version, triton_url, tls=tls, in_use=using)
    except VersionInUse as exc:
        return Release(version, "kept", tuple(exc.users))
    except NotFound:  # a retire run again after the version went (or never published)
        return Release(version, "absent")
    except RetrievalError as exc:
        return Release(version, "failed", error=exc)
    return Release(version, "unpublished")
