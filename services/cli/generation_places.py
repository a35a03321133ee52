"""Where ``index rollout | rollback | retire | generations`` find the store, Triton and the
shard replicas, how a builder is wired from their flags, and how the package's errors are
worded back in flags (docs/generations.md).

:func:`places` resolves the connection flags (or the local stack's stack.json);
:func:`builder` wires a :class:`~services.generations.builder.RolloutBuilder`;
:func:`in_flags` turns the package's domain errors, which name no flag, into messages
that start with (or name) the flag that supplies what is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.cli.common import client_tls, tls_flags, triton_tls


@dataclass(frozen=True)
class Places:
    redis_url: str
    triton_url: str | None
    triton_repo: Path | None
    triton_tls: Any
    index_root: Path
    shard_tls: Any = None  # ClientTLS to the shard replicas; None: plaintext


def places(args: argparse.Namespace) -> Places:
    """The store, Triton, the model repository, the index root and the replicas' TLS:
    the flags given, else the local stack's (--run-dir)."""
    from services.client.gateway import stack_run_dir
    from services.common.errors import FailedPrecondition
    from services.stack.endpoints import read_endpoints

    ca, cert, key = tls_flags(args, "triton")  # half a key pair: refused before anything
    stack = read_endpoints(stack_run_dir(args.stack_run_dir))
    # a client certificate without a CA: refused here
    triton = triton_tls(ca, cert, key, stack.internal_tls if stack else None)
    url = _redis_url(args, stack)
    if not url:
        raise FailedPrecondition(
            "no store: give --redis-url (or --redis-url-file), or --run-dir of a running "
            "local stack"
        )
    shard_tls = _shard_tls(args, stack.internal_tls if stack else {})
    repo = getattr(args, "triton_repo", None) or (
        Path(stack.triton_repository) if stack and stack.triton_repository else None
    )
    root = getattr(args, "index_root", None) or (
        Path(stack.index_root) if stack and stack.index_root else Path("generations")
    )
    return Places(
        url,
        getattr(args, "triton_url", None) or (stack.triton_grpc if stack else None) or None,
        repo,
        triton,
        root,
        shard_tls,
    )


def _redis_url(args: argparse.Namespace, stack: Any) -> str:
    from services.common.errors import FailedPrecondition
    from services.process.redis_client import read_redis_url

    if args.redis_url_file:
        try:
            return read_redis_url(args.redis_url_file)
        except ValueError as exc:
            raise FailedPrecondition(str(exc)) from None
    return str(args.redis_url or (stack.redis_url_with_secrets() if stack else ""))


def _shard_tls(args: argparse.Namespace, stack_paths: dict[str, str]) -> Any:
    """--tls-ca / --tls-client-cert / --tls-client-key when given, else the local stack's
    internal TLS (stack.json; none without `up --tls`); its files checked now."""
    given = tls_flags(args, "tls")  # half a key pair: refused here
    ca, cert, key = given if any(given) else [stack_paths.get(n) for n in ("ca", "cert", "key")]
    return client_tls(ca, cert, key, "shard replicas' TLS")


def client(url: str) -> Any:
    """A client of the store at ``url``, once it answered a PING (a store that cannot be
    reached is said naming --redis-url, not in a traceback at the first read)."""
    from services.cli.common import reachable_store

    return reachable_store(url)


def confirm(args: argparse.Namespace, question: str) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        print(f"{question}\nerror: not a terminal: add --yes to go ahead", file=sys.stderr)
        return False
    answer = input(f"{question} [y/N] ").strip().lower()
    return answer in ("y", "yes")


def encoders(where: Places) -> Any:
    """The encoder of a generation: Triton's ``embed`` at that generation's version."""
    from services.common.encoder_spec import EncoderSpec
    from services.common.errors import FailedPrecondition
    from services.encoder.base import DOCUMENT_PRIORITY
    from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig

    async def make(spec: EncoderSpec) -> Any:
        if not where.triton_url:
            raise FailedPrecondition(
                "no Triton to re-embed with: give --triton-url, or --run-dir of a running "
                "local stack"
            )
        return await TritonEncoder.connect(
            TritonEncoderConfig(
                where.triton_url,
                model=spec.model or "embed",
                model_version=str(spec.version) if spec.version else "",
                default_timeout_s=60.0,
                tls=where.triton_tls,
                priority=DOCUMENT_PRIORITY,  # queries' encodes go before the builder's batches
            )
        )

    return make


# The flag each of a plan's options comes from (PlanRefused.option → the flag).
PLAN_FLAGS = {"retrain": "--retrain", "shards": "--shards", "encoder": "--encoder"}


@contextlib.contextmanager
def in_flags() -> Iterator[None]:
    """The package's errors say what is missing or refused; this adds which flag."""
    from services.common.errors import FailedPrecondition, InvalidArgument
    from services.generations.errors import (
        NoModelRepository,
        PlanRefused,
        SourceAddressesUnknown,
        TransportMismatch,
    )

    try:
        yield
    except PlanRefused as exc:
        raise InvalidArgument(f"{PLAN_FLAGS[exc.option]} {exc.message}") from None
    except SourceAddressesUnknown as exc:
        raise FailedPrecondition(f"--retrain: {exc.message}: give --source-shards") from None
    except NoModelRepository as exc:
        raise FailedPrecondition(
            f"--encoder: {exc.message} (give --triton-repo, or --run-dir of a running local "
            "stack; or `index rollout --abort`)"
        ) from None
    except TransportMismatch as exc:
        hint = (
            "give --tls-ca (and --tls-client-cert and --tls-client-key when they require "
            "client certificates, as under `up --tls`), or --run-dir of the local stack"
            if exc.replica_tls
            else "drop the --tls-* flags"
        )
        raise FailedPrecondition(f"{exc.message}: {hint}") from None


def builder(
    args: argparse.Namespace,
    where: Places,
    store: Any,
    progress: Any = None,
    publisher: Callable[[str, bool], Any] | None = None,
) -> Any:
    """A builder with the run flags of ``index rollout`` / ``index rollback``."""
    from services.generations.builder import RolloutBuilder, RolloutOptions

    options = RolloutOptions(
        index_root=where.index_root,
        batch=getattr(args, "batch", 64),
        sample=getattr(args, "sample", 100_000),
        parallel=getattr(args, "parallel", 2),
        switch_lag=getattr(args, "switch_lag", 256),
        max_held_entries=getattr(args, "max_held_entries", 200_000),
        wait_for_shards=not getattr(args, "no_shard_wait", False),
        shard_wait_s=getattr(args, "shard_wait_s", 300.0),
        pace_ratio=getattr(args, "pace", None),
        catch_up_factor=getattr(args, "catch_up_factor", 4.0),
    )
    return RolloutBuilder(
        store,
        encoders(where),
        options,
        progress,
        source_addresses=getattr(args, "source_shards", None),
        shard_tls=where.shard_tls,
        publisher=publisher,
    )


def progress(args: argparse.Namespace) -> Any:
    from services.generations.progress import ConsoleProgress

    return ConsoleProgress(args.metrics_port, enabled=not args.quiet)


def publish_on(where: Places) -> Callable[[str, frozenset[int] | None, bool], Any] | None:
    """The publish phase's work (``--encoder``, under the rollout lock): the folder
    published into the repository and loaded by the Tritons named, said on stderr; None
    without a repository (a rollout that needs one is refused before the lock). Its
    ``int8_unmeasured`` is the plan's (``--int8-unmeasured``, ``publish_version``)."""
    repo = where.triton_repo
    if repo is None:
        return None

    def publish(folder: str, cpus: frozenset[int] | None, int8_unmeasured: bool) -> Any:
        from services.encoder.serve.publish import publish_version

        print(f"publishing {folder} into {repo} ...", file=sys.stderr)
        spec = publish_version(
            repo,
            Path(folder),
            where.triton_url,
            tls=where.triton_tls,
            cpus=cpus,
            int8_unmeasured=int8_unmeasured,
        )
        print(f"published as {spec.model} version {spec.version} ({spec.dim}-d)", file=sys.stderr)
        return spec

    return publish
