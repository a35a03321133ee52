"""``gtr-retrieval index rollout | rollback | retire | generations``: index generations
(docs/generations.md). The builder is :mod:`services.generations.builder`; this module
is the commands' flags, the connection to the store and Triton, and the output."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.cli.common import (
    add_command,
    client_tls,
    group_commands,
    positive_int,
    tls_flags,
    triton_tls,
)

# `index retire`'s exit status when the generation was retired but its encoder version
# stays published (Triton could not be asked, or refused the load): not 0, so a script or
# Job notices what is left to do; not 2 (a refusal: nothing changed), since it did retire.
ENCODER_KEPT = 3

COST = (
    "During a rollout the new generation's shards run beside the serving one's (about "
    "twice the index's memory, and Triton serves both encoder versions); a reshard also "
    "copies the documents into the new shard count's keys (a second copy of the document "
    "store until the old generation is retired)."
)


def _connection_flags(
    parser: argparse.ArgumentParser, triton: bool = False, *, retire: bool = False
) -> None:
    """--run-dir and the store's flags; ``triton``: a builder's Triton flags and
    --index-root; ``retire``: the Triton flags `index retire` unpublishes with."""
    names = (
        ", Triton, the model repository and the index root"
        if triton
        else ", Triton and the model repository"
        if retire
        else ""
    )
    parser.add_argument(
        "--run-dir",
        dest="stack_run_dir",
        default=None,
        metavar="DIR",
        help="Run directory of the local stack ('up --run-dir'): its stack.json names Redis"
        + names
        + " (default: $GTR_RUN_DIR, else .run). Flags given override it.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--redis-url",
        default=None,
        help="The store: redis://host:port/0 or redis+cluster://host:port,... (default: "
        "the local stack's).",
    )
    where.add_argument(
        "--redis-url-file",
        default=None,
        help="A file whose first line is the Redis URL (keeps a password off the command line).",
    )
    if triton or retire:
        parser.add_argument(
            "--triton-url",
            default=None,
            help="Triton's gRPC address(es) that "
            + ("re-embed the documents" if triton else "unload the retired encoder version")
            + " (default: the local stack's).",
        )
        parser.add_argument(
            "--triton-repo",
            type=Path,
            default=None,
            metavar="DIR",
            help="Triton's model repository: "
            + (
                "--encoder is published into it as the next version of embed"
                if triton
                else "the retired generation's version of embed is unpublished from it when "
                "no other generation uses it"
            )
            + " (default: the local stack's).",
        )
        for flag, what in (
            ("--triton-ca", "PEM CA to trust: talk TLS to Triton"),
            (
                "--triton-client-cert",
                "PEM client certificate for Triton (mTLS), with --triton-client-key",
            ),
            ("--triton-client-key", "PEM key of --triton-client-cert"),
        ):
            parser.add_argument(flag, default=None, help=f"{what} (default: the local stack's).")
    if triton:
        parser.add_argument(
            "--index-root",
            type=Path,
            default=None,
            help="Where the new generation's trained index goes (<root>/<generation>; "
            "default: the local stack's, else ./generations). The shards of the generation "
            "must be able to read it.",
        )


def _run_flags(parser: argparse.ArgumentParser, rollout: bool) -> None:
    """The flags of a builder run, declared once for ``index rollout`` and ``index
    rollback`` (a rollback replays only the log, so it has no training, bulk or reshard
    flags and shorter help); both then take the connection flags with Triton's."""

    def both(rollout_help: str, rollback_help: str) -> str:
        return rollout_help if rollout else rollback_help

    parser.add_argument(
        "--batch",
        type=positive_int,
        default=64,
        help=both(
            "Documents (or log entries) per batch; progress is saved after each (64).",
            "Log entries per batch (64).",
        ),
    )
    if rollout:
        parser.add_argument(
            "--sample",
            type=positive_int,
            default=100_000,
            help="Training vectors at most (100000).",
        )
    parser.add_argument(
        "--parallel", type=positive_int, default=2, help="Encoder batches in flight (2)."
    )
    if rollout:
        parser.add_argument(
            "--switch-lag",
            type=positive_int,
            default=256,
            help="Switch once the replay is at most this many source log entries behind (256).",
        )
    parser.add_argument(
        "--shard-wait-s",
        type=float,
        default=300.0,
        help=both(
            "How long the switch waits for the new generation's replicas to apply its "
            "logs (300; three attempts, writes resume between them).",
            "How long the switch waits for the replicas (300).",
        ),
    )
    parser.add_argument(
        "--no-shard-wait",
        action="store_true",
        help=both(
            "Switch without waiting for the new generation's replicas (only when "
            "nothing searches it yet: searches may see it incomplete).",
            "Switch without waiting for the replicas.",
        ),
    )
    if rollout:
        parser.add_argument(
            "--cpus",
            default=None,
            metavar="LIST",
            help="A CPU budget ('1', '2-3'): the builder, the new encoder version's Triton "
            "stub and the new generation's shards run on these CPUs and the local stack's "
            "serving processes on the others; the new generation's processes join serving's "
            "CPUs before the switch, and the budget ends once this command has exited "
            "(docs/generations.md: on shared cores it keeps search latency, at the cost of "
            "re-embedding speed). Default: no budget, every process on every CPU.",
        )
        parser.add_argument(
            "--source-shards",
            default=None,
            metavar="SPEC",
            help="--retrain: the serving generation's replicas ('host:port,host:port;"
            "host:port') when {gtr}:addrs does not name them.",
        )
    _shard_tls_flags(
        parser,
        "talk TLS to them",
        both("--retrain's export of the serving replicas' vectors and ", "")
        + "the switch's wait for the new serving replicas; ",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help=both("Serve Prometheus metrics (gtr_rollout_*) on this port.", "Prometheus port."),
    )
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    parser.add_argument("--yes", action="store_true", help="Do not ask before starting.")
    _connection_flags(parser, triton=True)


def _shard_tls_flags(parser: argparse.ArgumentParser, ca_use: str, ca_when: str = "") -> None:
    """--tls-ca, --tls-client-cert and --tls-client-key: the shard replicas' TLS, read by
    :func:`_shard_tls`; the CA's help says ``ca_use`` (what it is for) and ``ca_when``."""
    stack = "default: the local stack's"
    parser.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help=f"PEM CA of the shard replicas: {ca_use} ({ca_when}{stack}).",
    )
    parser.add_argument(
        "--tls-client-cert",
        default=None,
        metavar="PEM",
        help="PEM client certificate for replicas that require one (mTLS, "
        f"as under `up --tls`; {stack}).",
    )
    parser.add_argument(
        "--tls-client-key",
        default=None,
        metavar="PEM",
        help=f"PEM key of --tls-client-cert ({stack}).",
    )


def add_cli(sub: Any) -> None:
    """Add rollout, rollback, retire and generations to the ``index`` command."""
    isub = group_commands(sub, "index")
    rollout = add_command(
        isub,
        "rollout",
        _rollout,
        help="Build the next index generation beside the serving one, then switch to it.",
        description=(
            "Builds the next generation (a new encoder, a retrained quantizer or another "
            "shard count) beside the serving one while it keeps serving, then switches "
            "with one alias change (docs/generations.md). Phases: train (encode a sample "
            "of the stored documents with the new encoder and train IVF-PQ on it with the "
            "recall-tuned nprobe, as `index train`), bulk (re-embed every stored document "
            "through Triton), catch_up (replay every write since the start from the "
            "serving generation's logs), switch (writes pause for the final drain, "
            "searches never do). --retrain instead reuses the vectors the serving shards "
            "hold (no re-embedding; see docs/generations.md for what that costs in "
            "recall). Progress bar with ETA on stderr; Prometheus metrics gtr_rollout_* "
            "on --metrics-port. Killed at any point, `index rollout` again resumes from "
            "the saved phase and position; `index rollout --abort` gives up instead. " + COST
        ),
    )
    what = rollout.add_mutually_exclusive_group()
    what.add_argument(
        "--encoder",
        type=Path,
        default=None,
        metavar="DIR",
        help="A new encoder: a sentence-transformers checkpoint or an `encoder export` "
        "folder, published (once the rollout lock is taken) into the Triton repository as "
        "the next version of embed (refused, with nothing changed, when embed cannot serve "
        "its width or tokenizer).",
    )
    what.add_argument(
        "--retrain",
        action="store_true",
        help="Same encoder: retrain the quantizer on the vectors the serving shards hold "
        "(decoded from their SQ8 codes: no re-embedding). What `index drift-watch` runs.",
    )
    what.add_argument(
        "--abort",
        action="store_true",
        help="Give up the recorded rollout: writes go back to the serving generation, the "
        "target is marked failed (`index retire` deletes it). Refused while its builder "
        "runs (stop it first); a builder on another host counts as stopped once its "
        "heartbeat is 15 s old.",
    )
    rollout.add_argument(
        "--shards",
        type=positive_int,
        default=None,
        help="The new generation's shard count (default: the serving one's). Another "
        "count copies the documents into its own keys as the rollout goes.",
    )
    _run_flags(rollout, rollout=True)

    rollback = add_command(
        isub,
        "rollback",
        _rollback,
        help="Make the previous generation serve again (writes since the switch replayed).",
        description=(
            "A rollout whose target is the previous generation: no training and no bulk; "
            "every write since the switch is replayed from the serving generation's logs "
            "into it, re-embedded with its encoder, then the same switch. Refused "
            "(FAILED_PRECONDITION) when there is no previous generation."
        ),
    )
    _run_flags(rollback, rollout=False)

    retire = add_command(
        isub,
        "retire",
        _retire,
        help="Delete a generation that does not serve (default: the previous one).",
        description=(
            "Deletes the generation's logs, snapshot registrations and the rollout's "
            "bookkeeping, and, when no other generation has its shard count, that "
            "layout's documents; marks it retired (its shards are stopped; `index "
            "rollback` to it is no longer possible). Refused for the serving generation. "
            "Then, when no generation in a running state (serving, previous, a rollout's "
            "target) uses its encoder version, unpublishes that version of embed from the "
            "Triton repository and has Triton unload it (as `encoder unpublish`). Exit "
            f"status {ENCODER_KEPT} when the generation was retired but its version could "
            "not be unpublished (Triton unreachable or refusing the load): the warning "
            "names the `encoder unpublish` command to run later (or run this retire "
            "again). Without a repository (no --triton-repo, no local stack) the version "
            "is left published and a note says so (exit status 0)."
        ),
    )
    retire.add_argument("--generation", default=None, help="Which (default: the previous one).")
    retire.add_argument("--yes", action="store_true", help="Do not ask.")
    _connection_flags(retire, retire=True)

    listing = add_command(
        isub,
        "generations",
        _generations,
        help="List the index generations: state, size, encoder, drift.",
        description=(
            "Every generation with its state (building, catching_up, switching, serving, "
            "previous, retired, failed), the alias (serving / previous), shard count, "
            "encoder (Triton model version, width, source), size (documents and bytes of "
            "one replica per shard, from the replicas' Stats), drift (the highest PQ error "
            "ratio of its replicas) and, while one runs, the rollout's phase and progress. "
            "The replicas are asked over the rollout's shard TLS (--tls-*, by default the "
            "local stack's); a replica that does not answer counts as down and its "
            "generation's size is unknown (?)."
        ),
    )
    listing.add_argument("--json", action="store_true", help="Print JSON.")
    _shard_tls_flags(listing, "ask their Stats over TLS")
    _connection_flags(listing)


# --- where things are --------------------------------------------------------------------


@dataclass(frozen=True)
class Places:
    redis_url: str
    triton_url: str | None
    triton_repo: Path | None
    triton_tls: Any
    index_root: Path
    shard_tls: Any = None  # ClientTLS to the shard replicas; None: plaintext


def _places(args: argparse.Namespace) -> Places:
    from services.client.gateway import stack_run_dir
    from services.common.errors import FailedPrecondition
    from services.common.redis_client import read_redis_url
    from services.stack.endpoints import read_endpoints

    ca, cert, key = tls_flags(args, "triton")  # half a key pair: refused before anything
    stack = read_endpoints(stack_run_dir(args.stack_run_dir))
    # a client certificate without a CA: refused here
    triton = triton_tls(ca, cert, key, stack.internal_tls if stack else None)
    if args.redis_url_file:
        try:
            url = read_redis_url(args.redis_url_file)
        except ValueError as exc:
            raise FailedPrecondition(str(exc)) from None
    else:
        url = args.redis_url or (stack.redis_url_with_secrets() if stack else "")
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


def _shard_tls(args: argparse.Namespace, stack_paths: dict[str, str]) -> Any:
    """--tls-ca / --tls-client-cert / --tls-client-key when given, else the local stack's
    internal TLS (stack.json; none without `up --tls`); its files checked now."""
    given = tls_flags(args, "tls")  # half a key pair: refused here
    ca, cert, key = given if any(given) else [stack_paths.get(n) for n in ("ca", "cert", "key")]
    return client_tls(ca, cert, key, "shard replicas' TLS")


def _client(url: str) -> Any:
    from services.common.redis_client import sync_client

    return sync_client(url, socket_timeout=30.0)


def _confirm(args: argparse.Namespace, question: str) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        print(f"{question}\nerror: not a terminal: add --yes to go ahead", file=sys.stderr)
        return False
    answer = input(f"{question} [y/N] ").strip().lower()
    return answer in ("y", "yes")


def _encoders(places: Places) -> Any:
    """The encoder of a generation: Triton's ``embed`` at that generation's version."""
    from services.common.errors import FailedPrecondition
    from services.encoder.base import DOCUMENT_PRIORITY
    from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig
    from services.generations.registry import EncoderSpec

    async def make(spec: EncoderSpec) -> Any:
        if not places.triton_url:
            raise FailedPrecondition(
                "no Triton to re-embed with: give --triton-url, or --run-dir of a running "
                "local stack"
            )
        return await TritonEncoder.connect(
            TritonEncoderConfig(
                places.triton_url,
                model=spec.model or "embed",
                model_version=str(spec.version) if spec.version else "",
                default_timeout_s=60.0,
                tls=places.triton_tls,
                priority=DOCUMENT_PRIORITY,  # queries' encodes go before the builder's batches
            )
        )

    return make


@contextlib.contextmanager
def _in_flags() -> Iterator[None]:
    """The package's errors say what is missing; this adds which flag supplies it."""
    from services.common.errors import FailedPrecondition
    from services.generations.errors import (
        NoModelRepository,
        SourceAddressesUnknown,
        TransportMismatch,
    )

    try:
        yield
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


def _builder(
    args: argparse.Namespace, places: Places, client: Any, progress: Any, publisher: Any = None
) -> Any:
    from services.generations.builder import RolloutBuilder, RolloutOptions

    options = RolloutOptions(
        index_root=places.index_root,
        batch=args.batch,
        sample=getattr(args, "sample", 100_000),
        parallel=args.parallel,
        switch_lag=getattr(args, "switch_lag", 256),
        wait_for_shards=not args.no_shard_wait,
        shard_wait_s=args.shard_wait_s,
    )
    return RolloutBuilder(
        client,
        _encoders(places),
        options,
        progress,
        source_addresses=getattr(args, "source_shards", None),
        shard_tls=places.shard_tls,
        publisher=publisher,
    )


def _progress(args: argparse.Namespace) -> Any:
    from services.generations.progress import ConsoleProgress

    return ConsoleProgress(args.metrics_port, enabled=not args.quiet)


# --- the commands --------------------------------------------------------------------------


def _rollout(args: argparse.Namespace) -> int:
    from services.common.cpus import budget_for, pin_process
    from services.generations.builder import RolloutPlan
    from services.generations.registry import Registry

    budget = budget_for(args.cpus) if args.cpus else None
    if budget:  # from here on (the export of --encoder too) this process runs there
        pin_process(os.getpid(), budget)
    places = _places(args)
    client = _client(places.redis_url)
    registry = Registry(client)
    if args.abort:
        from services.generations.builder import RolloutBuilder, RolloutOptions

        aborted = RolloutBuilder(
            client, _encoders(places), RolloutOptions(index_root=places.index_root)
        ).abort()
        target = aborted.target
        if aborted.phase == "publish":  # stopped before its target was recorded
            print(
                f"aborted the rollout to {target} (phase publish): {aborted.source} "
                f"serves and takes the writes as before; {target} was never recorded. If "
                "its encoder was published before it stopped, no generation uses that "
                "version: `gtr-retrieval encoder versions` lists it, `encoder unpublish "
                "--version N` frees it"
            )
            return 0
        print(
            f"aborted the rollout to {target} (phase {aborted.phase}): "
            f"{aborted.source} takes the writes; {target} is "
            f"{registry.get(target).state}"
        )
        return 0
    running = registry.running()
    serving = registry.serving()
    encoder_dir = str(args.encoder.resolve()) if args.encoder is not None else ""
    if running is None:
        shards = args.shards or serving.num_shards
        change = (
            f"encoder {args.encoder}"
            if args.encoder
            else "the quantizer retrained on the stored vectors"
            if args.retrain
            else f"{serving.encoder.model} v{serving.encoder.version} re-embedded"
        )
        question = (
            f"roll out a new generation from {serving.name} ({serving.num_shards} shards): "
            f"{change}, {shards} shards.\n{COST}\nGo ahead?"
        )
    else:
        # a live builder or other options: refused (naming it) before asking anything
        _builder(args, places, client, None).check_resumable(
            running,
            RolloutPlan(num_shards=args.shards, retrain=args.retrain, encoder_dir=encoder_dir),
        )
        question = (
            f"resume the rollout to {running.target} from {running.source} (phase {running.phase})?"
        )
    if not _confirm(args, question):
        return 1
    with contextlib.ExitStack() as stack:
        entered: list[bool] = []

        def budgeted() -> None:
            if budget and not entered:
                from services.generations.budget import CpuBudget

                stack.enter_context(CpuBudget(client, budget, places.triton_repo))
                entered.append(True)

        # --encoder is published by the builder's first phase, under the rollout lock (a
        # resume in that phase publishes the same folder again); the budget starts after
        # the publish: the export and Triton's load of the new version run on every CPU.
        publishing = args.encoder is not None if running is None else running.phase == "publish"
        if not publishing:
            budgeted()
        plan = RolloutPlan(num_shards=args.shards, retrain=args.retrain, encoder_dir=encoder_dir)
        progress = _progress(args)
        started = time.monotonic()
        try:
            builder = _builder(args, places, client, progress, _publisher(places, budget, budgeted))
            with _in_flags():
                serving_now = asyncio.run(builder.rollout(plan))
        finally:
            progress.close()
    print(
        f"{serving_now.name} serves ({serving_now.num_shards} shards, encoder "
        f"{serving_now.encoder.model} v{serving_now.encoder.version}) after "
        f"{time.monotonic() - started:.0f} s; `index rollback` returns to "
        f"{registry.alias().previous}"
    )
    _note_displaced(registry)
    return 0


def _note_displaced(registry: Any) -> None:
    """Say which generations still run their shards though no rollback can reach them."""
    alias = registry.alias()
    for gen in registry.all():
        if gen.state == "previous" and gen.name != alias.previous:
            print(
                f"note: {gen.name} is no longer the rollback target but its shards still "
                f"run: `index retire --generation {gen.name}` frees them"
            )


def _publisher(
    places: Places, cpus: frozenset[int] | None, published: Callable[[], None]
) -> Callable[[str], Any] | None:
    """The builder's publish phase (``--encoder``, under the rollout lock): the folder
    published into the repository and loaded by the Tritons named, then ``published()``;
    None without a repository (a rollout that needs one is refused before the lock)."""
    repo = places.triton_repo
    if repo is None:
        return None

    def publish(folder: str) -> Any:
        from services.encoder.serve.versions import publish_version

        print(f"publishing {folder} into {repo} ...", file=sys.stderr)
        spec = publish_version(
            repo, Path(folder), places.triton_url, tls=places.triton_tls, cpus=cpus
        )
        print(f"published as {spec.model} version {spec.version} ({spec.dim}-d)", file=sys.stderr)
        published()
        return spec

    return publish


def _rollback(args: argparse.Namespace) -> int:
    from services.generations.registry import Registry

    places = _places(args)
    client = _client(places.redis_url)
    alias = Registry(client).alias()
    question = f"roll back from {alias.serving} to {alias.previous or '(none)'}?"
    if alias.previous and not _confirm(args, question):
        return 1
    progress = _progress(args)
    started = time.monotonic()
    try:
        with _in_flags():
            serving = asyncio.run(_builder(args, places, client, progress).rollback())
    finally:
        progress.close()
    print(
        f"{serving.name} serves again after {time.monotonic() - started:.0f} s "
        f"({alias.serving} is previous)"
    )
    _note_displaced(Registry(client))
    return 0


def _retire(args: argparse.Namespace) -> int:
    from services.generations.lifecycle import retire
    from services.generations.registry import Registry

    places = _places(args)
    client = _client(places.redis_url)
    registry = Registry(client)
    name = args.generation or registry.alias().previous or None
    if name is not None:
        registry.get(name)  # NotFound before asking
    question = (
        f"retire {name} (its logs and keys deleted; its encoder version unpublished "
        "from Triton when no other generation uses it)?"
    )
    if name is not None and not _confirm(args, question):
        return 1
    done = retire(client, args.generation)
    print(
        f"{done.generation.name} retired: {done.keys_deleted} keys deleted"
        + (
            f", {done.documents_deleted} documents of its {done.generation.num_shards}-shard layout"
            if done.documents_deleted
            else ""
        )
    )
    return _release_encoder(args, places, registry, done.generation)


def _release_encoder(args: argparse.Namespace, places: Places, registry: Any, gen: Any) -> int:
    """Say what became of ``gen``'s version of embed (the decision is
    :func:`services.generations.encoders.release_encoder`'s); 0, or ENCODER_KEPT when it
    could not be unpublished."""
    from services.generations.encoders import release_encoder

    done = release_encoder(registry, gen, places.triton_repo, places.triton_url, places.triton_tls)
    version = done.version
    later = f"gtr-retrieval encoder unpublish --version {version}" + "".join(
        f" {flag} {value}"
        for flag, value in (
            ("--repo", places.triton_repo or "DIR"),
            ("--triton-url", places.triton_url or ("URL" if not places.triton_repo else "")),
            ("--run-dir", args.stack_run_dir),
            ("--triton-ca", args.triton_ca),
            ("--triton-client-cert", args.triton_client_cert),
            ("--triton-client-key", args.triton_client_key),
        )
        if value
    )
    if done.outcome == "kept":
        print(f"embed version {version} stays published: the encoder of {', '.join(done.users)}")
    elif done.outcome == "no_repository":
        print(
            f"note: embed version {version} is no longer used by any generation but stays "
            "published: no Triton model repository named (--triton-repo, or --run-dir of "
            f"the local stack); `{later}` frees it",
            file=sys.stderr,
        )
    elif done.outcome == "absent":
        print(f"embed version {version} is not in {places.triton_repo}: nothing to unpublish")
    elif done.outcome == "failed":
        message = done.error.message if done.error is not None else ""
        print(
            f"warning: {gen.name} is retired, but embed version {version}, its encoder, is "
            f"still published (Triton keeps it loaded): {message}\nrun `{later}` once "
            f"Triton answers (or `index retire --generation {gen.name}` again)",
            file=sys.stderr,
        )
        return ENCODER_KEPT
    else:
        where = (
            f" and unloaded by Triton at {places.triton_url}"
            if places.triton_url
            else (" (no Triton named: one serving it unloads it at its next load or restart)")
        )
        print(
            f"embed version {version} (no other generation uses it) unpublished from "
            f"{places.triton_repo}{where}"
        )
    return 0


def _generations(args: argparse.Namespace) -> int:
    from services.generations.lifecycle import generation_sizes
    from services.generations.registry import Registry, describe

    places = _places(args)
    client = _client(places.redis_url)
    registry = Registry(client)
    alias = registry.alias()
    base = registry.base_shards()
    rows = []
    for gen in registry.all():
        row = describe(gen, alias)
        sizes = generation_sizes(
            client, gen, base, registry.addresses(gen.name), tls=places.shard_tls
        )
        row.update(
            documents=sizes.documents,
            bytes=sizes.bytes,
            drift=sizes.drift,
            log_entries=sizes.log_entries,
            replicas_up=sizes.replicas_up,
            replicas=sizes.replicas,
            addresses=registry.addresses(gen.name),
        )
        rows.append(row)
    running = registry.rollout()
    if args.json:
        print(
            json.dumps(
                {"alias": alias.__dict__, "generations": rows, "rollout": running},
                indent=2,
                sort_keys=True,
            )
        )
        return 0
    header = ("NAME", "STATE", "ALIAS", "SHARDS", "ENCODER", "DOCS", "BYTES", "DRIFT", "REPLICAS")
    table = [header]
    for r in rows:
        enc = r["encoder"]
        table.append(
            (
                r["name"],
                r["state"],
                r["alias"] or "-",
                str(r["num_shards"]),
                f"{enc['model']} v{enc['version']} {enc['dim']}-d"
                + (f" ({Path(enc['source']).name})" if enc.get("source") else ""),
                _n(r["documents"]),
                _bytes(r["bytes"]),
                "-" if r["drift"] is None else f"{r['drift']:.2f}",
                f"{r['replicas_up']}/{r['replicas']}" if r["replicas"] else "-",
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    print(f"alias epoch {alias.epoch}")
    if running:
        print(
            f"rollout {running.get('source')} -> {running.get('target')} "
            f"({running.get('kind')}, {running.get('mode')}): phase {running.get('phase')}, "
            f"{running.get('done', '0')}/{running.get('total', '?')} documents, builder pid "
            f"{running.get('pid')} on {running.get('host')}, last heard "
            f"{time.time() - float(running.get('beat', '0') or 0):.0f} s ago"
        )
    return 0


def _n(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "?"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
