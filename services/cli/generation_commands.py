"""``gtr-retrieval index rollout | rollback | retire | generations``: index generations
(docs/generations.md). This module registers the commands and declares their flags; the
handlers are :mod:`services.cli.generation_handlers`, the wiring and the flags' wording
of errors :mod:`services.cli.generation_places`, and every decision
:mod:`services.generations` (the builder, :mod:`services.generations.operations`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.cli import generation_handlers as handlers
from services.cli.common import (
    INT8_UNMEASURED_HELP,
    add_command,
    group_commands,
    non_negative_int,
    positive_int,
)
from services.cli.generation_handlers import COST, ENCODER_KEPT

__all__ = ["COST", "ENCODER_KEPT", "add_cli"]


def _add_connection_flags(
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
        _add_triton_flags(parser, triton)
    if triton:
        parser.add_argument(
            "--index-root",
            type=Path,
            default=None,
            help="Where the new generation's trained index goes (<root>/<generation>; "
            "default: the local stack's, else ./generations). The shards of the generation "
            "must be able to read it.",
        )


def _add_triton_flags(parser: argparse.ArgumentParser, builder: bool) -> None:
    """Triton's flags: a builder's (``builder``: it re-embeds and publishes) or `index
    retire`'s (it unpublishes)."""
    parser.add_argument(
        "--triton-url",
        default=None,
        help="Triton's gRPC address(es) that "
        + ("re-embed the documents" if builder else "unload the retired encoder version")
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
            if builder
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


# index rollout --pace's default: services.generations.pacing.DEFAULT_RATIO, which this
# module does not import (it pulls numpy into every command's start); a test holds them equal
PACE = 1.2


def _over_one_or_off(what: str) -> Callable[[str], float | None]:
    """An argparse type: a number over 1 (a ``what``), or "off" (None)."""

    def parse(value: str) -> float | None:
        if value.strip().lower() == "off":
            return None
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is neither a {what} nor 'off'") from None
        if not number > 1.0:  # a catch-up factor at 1 or less may never gain on the writes
            raise argparse.ArgumentTypeError(f"a {what} is over 1 (got {value})")
        return number

    return parse


def _either(rollout: bool, rollout_help: str, rollback_help: str) -> str:
    return rollout_help if rollout else rollback_help


def _add_run_flags(parser: argparse.ArgumentParser, rollout: bool) -> None:
    """The flags of a builder run, declared once for ``index rollout`` and ``index
    rollback`` (a rollback replays only the log, so it has no training, bulk or reshard
    flags and shorter help); both then take the connection flags with Triton's."""

    parser.add_argument(
        "--batch",
        type=positive_int,
        default=64,
        help=_either(
            rollout,
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
        "--parallel",
        type=positive_int,
        default=2,
        help="Batches in flight, and at most this many encode calls in flight: fewer while "
        "the calls are long, so a write's dual encode waits about 0.25 s behind them (2).",
    )
    if rollout:
        parser.add_argument(
            "--pace",
            type=_over_one_or_off("pace ratio"),
            default=PACE,
            metavar="RATIO|off",
            help="Pace the re-embedding on the searches the gateways answer: pause between "
            "encode calls whenever their p99 passes RATIO times their p99 over 30 s "
            "that ended 15 s before the builder started, so that its own start is not in it "
            f"(and 5 ms more at least; {PACE}). When searches stay "
            "slower with the re-embedding at its floor, the target is raised to their p99, "
            "never past 1.5 times the baseline (or RATIO, if higher). 'off': full "
            "speed, for a rollout whose encoder shares no CPU with serving. On 2 shared "
            "cores with writes at 21/s paced rollouts read 1.4-2.5x the p99 before them "
            "(median 1.7) and took 3-4x as long; unpaced, 2.3-2.6x (docs/generations.md, "
            '"Pacing").',
        )
        parser.add_argument(
            "--switch-lag",
            type=positive_int,
            default=256,
            help="Switch once the replay is at most this many source log entries behind (256).",
        )
    parser.add_argument(
        "--catch-up-factor",
        type=_over_one_or_off("catch-up factor"),
        default=4.0,
        metavar="FACTOR|off",
        help="Replay the catch-up at most FACTOR times the rate the serving generation's "
        "logs are written (and 50 entries/s at least), so that it gains on the writes "
        "without taking the cores the searches need; off: flat out (4; docs/generations.md, "
        '"The catch-up\'s pace").',
    )
    parser.add_argument(
        "--max-held-entries",
        type=non_negative_int,
        default=200_000,
        help="Abort the rollout (FAILED_PRECONDITION, its hold on the serving generation's "
        "logs released, the writes staying there) once more than this many of their "
        "entries wait to be replayed: a catch-up that cannot keep up with the writes must "
        "not grow Redis without end (200000, about 1 GB at 384 dimensions; 0: no bound).",
    )
    parser.add_argument(
        "--shard-wait-s",
        type=float,
        default=300.0,
        help=_either(
            rollout,
            "How long the switch waits for the new generation's replicas to apply its "
            "logs (300; three attempts, writes resume between them).",
            "How long the switch waits for the replicas (300).",
        ),
    )
    parser.add_argument(
        "--no-shard-wait",
        action="store_true",
        help=_either(
            rollout,
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
            "stub and the new generation's shards run on these CPUs only, the builder and "
            "the shards at the least scheduling weight (their sessions' autogroups at nice "
            "19: serving takes these CPUs whenever it wakes on them), while the local "
            "stack's serving processes keep every CPU; the new generation's processes join "
            "serving's CPUs and weight before the switch, and the budget ends with this "
            "command (docs/generations.md: on shared cores it keeps search latency, at the "
            "cost of re-embedding speed). On the local stack the budgeted processes (and this "
            "command when it leads its own session) are also paused while the gateway has a "
            "search in flight, at most 250 ms at a time (GTR_ROLLOUT_HOLD=0: never). Default: "
            "no budget, every process on every CPU.",
        )
        parser.add_argument(
            "--source-shards",
            default=None,
            metavar="SPEC",
            help="--retrain: the serving generation's replicas ('host:port,host:port;"
            "host:port') when {gtr}:addrs does not name them.",
        )
    _add_shard_tls_flags(
        parser,
        "talk TLS to them",
        _either(rollout, "--retrain's export of the serving replicas' vectors and ", "")
        + "the switch's wait for the new serving replicas; ",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help=_either(
            rollout, "Serve Prometheus metrics (gtr_rollout_*) on this port.", "Prometheus port."
        ),
    )
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    parser.add_argument("--yes", action="store_true", help="Do not ask before starting.")
    _add_connection_flags(parser, triton=True)


def _add_shard_tls_flags(parser: argparse.ArgumentParser, ca_use: str, ca_when: str = "") -> None:
    """--tls-ca, --tls-client-cert and --tls-client-key: the shard replicas' TLS, read by
    :func:`services.cli.generation_places.places`; the CA's help says ``ca_use`` (what it
    is for) and ``ca_when``."""
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
    _add_rollout(isub)
    _add_rollback(isub)
    _add_retire(isub)
    _add_generations(isub)


def _add_rollout(isub: Any) -> None:
    rollout = add_command(
        isub,
        "rollout",
        handlers.rollout,
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
    # its interpreter's teardown (torch, ONNX Runtime, faiss) would cost a core for ~1.6 s
    # as the new generation begins to serve: skipped (services.cli.main.exit_at_once)
    rollout.set_defaults(exit_at_once=True)
    what = rollout.add_mutually_exclusive_group()
    what.add_argument(
        "--encoder",
        type=Path,
        default=None,
        metavar="DIR",
        help="A new encoder: a sentence-transformers checkpoint or an `encoder export` "
        "folder, published (once the rollout lock is taken) into the Triton repository as "
        "the next version of embed (refused, with nothing changed, when embed cannot serve "
        "its width or tokenizer, or when the folder's int8 graphs fail their parity here or "
        "have no quality result: `encoder publish`).",
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
    rollout.add_argument(
        "--retrieval-setting",
        type=Path,
        default=None,
        metavar="FILE",
        help="A JSON retrieval setting for the new generation (docs/generations.md "
        "'Retrieval setting': fusion method, rrf_k, dense_weight, candidates, and the "
        "rerank checkpoint, weight and depth), recorded in its record: a search it serves "
        "that names no fusion gets it instead of the gateway's --fusion/--rrf-k/"
        "--dense-weight/--hybrid-candidates. Checked before anything is written (a bad file "
        "exits 2). Default: none, the gateway's flags, as before.",
    )
    rollout.add_argument(
        "--int8-unmeasured",
        action="store_true",
        help=f"With --encoder: {INT8_UNMEASURED_HELP}. Recorded with the rollout: a resume "
        "publishes the same way without it.",
    )
    _add_run_flags(rollout, rollout=True)


def _add_rollback(isub: Any) -> None:
    rollback = add_command(
        isub,
        "rollback",
        handlers.rollback,
        help="Make the previous generation serve again (writes since the switch replayed).",
        description=(
            "A rollout whose target is the previous generation: no training and no bulk; "
            "every write since the switch is replayed from the serving generation's logs "
            "into it, re-embedded with its encoder, then the same switch. Refused "
            "(FAILED_PRECONDITION) when there is no previous generation."
        ),
    )
    rollback.set_defaults(exit_at_once=True)
    _add_run_flags(rollback, rollout=False)


def _add_retire(isub: Any) -> None:
    retire = add_command(
        isub,
        "retire",
        handlers.retire,
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
    _add_connection_flags(retire, retire=True)


def _add_generations(isub: Any) -> None:
    listing = add_command(
        isub,
        "generations",
        handlers.generations,
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
    _add_shard_tls_flags(listing, "ask their Stats over TLS")
    _add_connection_flags(listing)
