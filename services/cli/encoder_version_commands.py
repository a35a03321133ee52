"""``gtr-retrieval encoder publish | unpublish | versions``: the encoder versions of model
``embed`` in a Triton repository, loaded and unloaded by a running Triton
(:mod:`services.encoder.serve.versions`; docs/encoder.md "Several encoder versions").

``add_versions(commands)`` registers the three sub-commands on the ``encoder`` group.
Every sub-command sets ``func(args) -> int`` (the process exit status). Heavy imports
happen inside the handlers, never at import time.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.cli.common import (
    INT8_UNMEASURED_HELP,
    add_command,
    reachable_store,
    tls_flags,
    triton_tls,
)


@dataclass(frozen=True)
class TritonPlace:
    """The repository and the Triton(s) a version command works on."""

    repo: Path
    url: str | None
    tls: Any
    redis_url: str = ""  # the local stack's store, when the repository is the stack's


def _triton_place(args: argparse.Namespace) -> TritonPlace:
    """--repo / --triton-url / --triton-ca… as given, else the local stack's (its
    stack.json: the repository it serves from, its Triton, its internal TLS)."""
    from services.client.gateway import stack_run_dir
    from services.common.errors import FailedPrecondition
    from services.stack.endpoints import read_endpoints

    ca, cert, key = tls_flags(args, "triton")  # half a key pair: refused before anything
    stack = read_endpoints(stack_run_dir(args.stack_run_dir))
    repo = args.repo or (stack.triton_repository if stack else "")
    if not repo:
        raise FailedPrecondition(
            "no model repository: give --repo, or --run-dir of a running local stack"
        )
    if stack and Path(repo).resolve() != Path(stack.triton_repository or "/").resolve():
        stack = None  # another repository than the stack's: its Triton is not the stack's
    url = getattr(args, "triton_url", None) or (stack.triton_grpc if stack else "") or None
    # a client certificate without a CA: refused
    tls = triton_tls(ca, cert, key, stack.internal_tls if stack else None)
    return TritonPlace(Path(repo), url, tls, stack.redis_url_with_secrets() if stack else "")


def _publish(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from services.encoder.serve.publish import publish_version

    place = _triton_place(args)
    spec = publish_version(
        place.repo,
        Path(args.model_dir),
        place.url,
        tls=place.tls,
        int8_unmeasured=args.int8_unmeasured,
    )
    if args.json:
        print(json.dumps(asdict(spec)))
        return 0
    loaded = (
        f"; loaded by Triton at {place.url}"
        if place.url
        else "; no Triton named: it serves it once asked to load embed, or restarted"
    )
    print(
        f"{spec.model} version {spec.version} in {place.repo}: {Path(args.model_dir).name} "
        f"(dim {spec.dim}, digest {spec.digest}){loaded}"
    )
    return 0


def _unpublish(args: argparse.Namespace) -> int:
    from services.common.errors import FailedPrecondition
    from services.encoder.serve.unpublish import VersionInUse, unpublish_version
    from services.generations.encoders import in_use
    from services.generations.registry import Registry

    place = _triton_place(args)
    redis_url = args.redis_url or place.redis_url
    if not redis_url:
        print(
            "no store named (--redis-url, --run-dir): not checked that no index "
            "generation uses this version",
            file=sys.stderr,
        )
    # the store answers first: an unpublish that cannot ask it whether a generation uses
    # the version stops here, before anything is removed
    client = reachable_store(redis_url, socket_timeout=5.0) if redis_url else None

    try:  # a version a generation, or a rollout publishing its encoder, still uses stays
        unpublish_version(
            place.repo,
            args.version,
            place.url,
            tls=place.tls,
            # asked under the publish lock (a rollout's publish waits)
            in_use=in_use(Registry(client), args.version) if client is not None else None,
        )
    except VersionInUse as exc:
        raise FailedPrecondition(
            f"embed version {args.version} is the encoder of generation(s) "
            f"{', '.join(exc.users)}: retire them first (`gtr-retrieval index retire`)"
        ) from None
    finally:
        if client is not None:
            client.close()
    where = f" and from Triton at {place.url}" if place.url else ""
    print(f"embed version {args.version} removed from {place.repo}{where}")
    return 0


def _versions(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from services.encoder.serve.versions import describe_versions

    specs = describe_versions(_triton_place(args).repo)
    if args.json:
        print(json.dumps([asdict(spec) for spec in specs]))
        return 0
    for spec in specs:
        print(
            f"{spec.model} version {spec.version}: dim {spec.dim}, "
            f"digest {spec.digest or '(none recorded)'}"
        )
    return 0


def _add_triton_place(p: argparse.ArgumentParser, *, triton: bool = True) -> None:
    """--run-dir, --repo (and --triton-url, TLS): the repository and the Triton(s)."""
    p.add_argument(
        "--run-dir",
        dest="stack_run_dir",
        default=None,
        metavar="DIR",
        help="run directory of the local stack ('up --run-dir'): its stack.json "
        "names the model repository, Triton and its TLS files (default: "
        "$GTR_RUN_DIR, else .run); flags given override it",
    )
    p.add_argument("--repo", help="the Triton model repository (default: the local stack's)")
    if not triton:
        p.set_defaults(triton_ca=None, triton_client_cert=None, triton_client_key=None)
        return
    p.add_argument(
        "--triton-url",
        help="Triton's gRPC address(es) (host:port, a list or dns:///name:port) "
        "that load the change (default: the local stack's; none: only the "
        "repository changes)",
    )
    for flag, what in (
        ("--triton-ca", "PEM CA to trust: talk TLS to Triton"),
        (
            "--triton-client-cert",
            "PEM client certificate for Triton (mTLS), with --triton-client-key",
        ),
        ("--triton-client-key", "PEM key of --triton-client-cert"),
    ):
        p.add_argument(flag, default=None, help=f"{what} (default: the local stack's)")


def add_versions(commands: Any) -> None:
    """Register ``encoder publish|unpublish|versions`` on the ``encoder`` group."""
    p = add_command(
        commands,
        "publish",
        _publish,
        help="add an encoder as the next version of embed in a Triton repository and load it",
        description="Export the checkpoint (the parity check gates it), add it as version "
        "N+1 of `embed` beside the versions served (cpu flavour: each version folder holds "
        "its own graph and tokenizer) and ask the running Triton to load it (explicit model "
        "control; no restart). Refused, with nothing changed: an encoder whose width or "
        "tokenizer `embed` cannot serve, and the gpu flavour. Publishing an export already "
        "there adds nothing and prints its version. An export's int8 graphs are checked "
        "again: parity against its FP32 graph, and a quality result of these very graphs "
        "(its gate record or the committed one), else refused. An index rollout to the new "
        "encoder uses that version (docs/generations.md).",
    )
    _add_triton_place(p)
    p.add_argument(
        "--model-dir",
        required=True,
        help="sentence-transformers checkpoint (or an `encoder export` folder)",
    )
    p.add_argument("--json", action="store_true", help="print the version as JSON")
    p.add_argument("--int8-unmeasured", action="store_true", help=INT8_UNMEASURED_HELP)

    p = add_command(
        commands,
        "unpublish",
        _unpublish,
        help="take a version of embed out of the repository and out of Triton",
        description="For an encoder no index generation uses any more (after `index "
        "retire`): the version folder and its parameters go, and the Tritons named by "
        "--triton-url load embed again without it (its memory freed). Refused "
        "(FAILED_PRECONDITION): the version of an index generation that is not retired, "
        "and the last version; an unknown one is NOT_FOUND.",
    )
    _add_triton_place(p)
    p.add_argument("--version", required=True, type=int, help="the version to take out")
    p.add_argument(
        "--redis-url",
        default=None,
        help="the store whose index generations must not use the version "
        "(default: the local stack's); a version a generation in a running "
        "state uses is refused",
    )

    p = add_command(
        commands,
        "versions",
        _versions,
        help="list the encoder versions of embed in a repository",
        description="Each version of embed with its width and digest (from the config's "
        "version.<n>.* parameters).",
    )
    _add_triton_place(p, triton=False)
    p.add_argument("--json", action="store_true", help="print them as JSON")
