"""Running Tritons load ``embed`` again, and a version is awaited there (issue #24).

**Loading: explicit model control.** Triton runs with ``--model-control-mode=explicit
--load-model=*`` (``services/encoder/serve/triton_server.py``; the local stack and the
chart start it so): at start it loads every model as before, and afterwards only a
``RepositoryModelLoad`` call changes what it serves. Publishing writes the version folder
(``config.pbtxt`` is not touched), then asks each Triton named by ``triton_url`` to load
``embed`` again; Triton loads the new version and leaves the loaded ones as they are: it
reloads a loaded version only when the config changed beyond ``instance_group`` and
``version_policy`` or when the version's folder, or a non-version entry of the model
folder, is newer than at its load (triton-inference-server/core ``ModelLifeCycle::
AsyncLoad``: ``ModelTimestamp::IsModelVersionModified``, ``ConfigChangeRequiresReload``).
Hence nothing here writes into the model folder or a loaded version's folder around a load:
the lock file exists from ``encoder repo`` on, a new version is staged under a dotted name
and renamed into place before the load, an unpublish takes the version out through
``version_policy`` (ignored by that comparison) before its folder goes, and
:func:`~services.encoder.serve.versions.clear_cpu_budgets` puts a folder's time back. A
repository of an older generator (``version.<n>.*`` config parameters) is converted by the
next publish, which is then the one load that reloads every version. Polling
(``--model-control-mode=poll``) was not chosen: Triton would pick up a version folder or
config half written, at a moment nobody chose, and a publish could not tell its caller
whether the new version loads. A load that fails (Triton down, or the new version does not
initialise) puts the repository back as it was and is an error: a publish is all or
nothing. A Triton started later loads every version at start.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from services.common.errors import FailedPrecondition, Unavailable
from services.encoder.build.repository import EMBED_MODEL
from services.encoder.runtime.triton_client import triton_addresses

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS

LOAD_TIMEOUT_S = 300.0  # one load of every version of embed (each initialises ONNX Runtime)
# How long a Triton with its own copy of the repository may take to have the new version
# (the chart's repository-sync links it every intervalSeconds, 10 by default, then loads).
READY_WITHIN_S = 120.0
AWAIT_EVERY_S = 0.5


def triton_servers(url: str) -> list[str]:
    """The ``host:port`` of every Triton named by ``url`` (a ``dns:`` target resolved)."""
    from services.rpc.discovery import is_dns_target, parse_dns_target, resolve

    addresses = triton_addresses(url)
    if len(addresses) == 1 and is_dns_target(addresses[0]):
        resolved = asyncio.run(resolve(parse_dns_target(addresses[0])))
        if not resolved:
            raise Unavailable(f"{url} names no Triton server now")
        return resolved
    return addresses


def load_everywhere(
    url: str,
    version: int | None,
    tls: ClientTLS | None,
    timeout_s: float,
    *,
    if_ready: bool = True,
) -> None:
    """Ask every Triton at ``url`` to load ``embed`` again and check that ``version`` (if
    given) is ready there; ``if_ready=False``: only the servers where it is not ready yet
    (a load reloads every version: not done for nothing)."""
    for address in triton_servers(url):
        if not if_ready and version is not None and _ready(address, version, tls, timeout_s):
            continue
        load_model(address, version, tls, timeout_s)


def _ready(address: str, version: int, tls: ClientTLS | None, timeout_s: float) -> bool:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from services.rpc.tls import channel

    with channel(address, tls) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        request = service_pb2.ModelReadyRequest(name=EMBED_MODEL, version=str(version))
        try:
            return bool(stub.ModelReady(request, timeout=timeout_s).ready)
        except grpc.RpcError:
            return False  # asked to load below, which says what is wrong


def load_model(
    address: str,
    version: int | None,
    tls: ClientTLS | None,
    timeout_s: float = LOAD_TIMEOUT_S,
    ready_within_s: float = READY_WITHIN_S,
) -> None:
    """``RepositoryModelLoad`` of ``embed`` at one Triton (it reads the repository again:
    new versions load, the loaded ones keep serving until the new model replaces them);
    then ``version`` must be ready within ``ready_within_s``. Unavailable when Triton
    cannot be asked, FailedPrecondition when it refuses the model (its message says why).

    A Triton that serves its own copy of the repository (the chart's Triton pods: a
    ``repository-sync`` sidecar links each new version folder from the shared repository
    within its interval and loads it) may answer this load before its copy has the
    version: the version is then awaited, and a version that failed to load there
    (Triton's repository index says UNAVAILABLE with the reason) ends the wait at once."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from services.rpc.tls import channel

    with channel(address, tls) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        try:
            stub.RepositoryModelLoad(
                service_pb2.RepositoryModelLoadRequest(model_name=EMBED_MODEL), timeout=timeout_s
            )
            if version is not None:
                _await_ready(stub, address, version, ready_within_s)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(
                    f"Triton at {address} could not be asked to load {EMBED_MODEL}: {details}"
                ) from None
            hint = (
                " (start it with --model-control-mode=explicit)"
                if ("not allowed" in details)
                else ""
            )
            raise FailedPrecondition(
                f"Triton at {address} did not load {EMBED_MODEL}"
                + (f" version {version}" if version else "")
                + f": {details}{hint}"
            ) from None


def _await_ready(stub: Any, address: str, version: int, within_s: float) -> None:
    """Until ``version`` of ``embed`` is ready at ``stub``'s Triton (see :func:`load_model`)."""
    from tritonclient.grpc import service_pb2

    until = time.monotonic() + within_s
    ready = service_pb2.ModelReadyRequest(name=EMBED_MODEL, version=str(version))
    while not stub.ModelReady(ready, timeout=max(1.0, within_s)).ready:
        index = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), timeout=within_s)
        for model in index.models:  # a version unloaded before (unpublished) says so
            if (model.name, model.version) == (EMBED_MODEL, str(version)) and (
                model.state == "UNAVAILABLE" and model.reason not in ("", "unloaded")
            ):
                raise FailedPrecondition(
                    f"Triton at {address} could not load {EMBED_MODEL} "
                    f"version {version}: {model.reason}"
                )
        if time.monotonic() >= until:
            raise FailedPrecondition(
                f"Triton at {address} loaded {EMBED_MODEL} but version {version} is not "
                f"there after {within_s:.0f} s: does it serve this repository (or a copy "
                "that a repository-sync keeps up to date)?"
            )
        time.sleep(AWAIT_EVERY_S)
