"""``gtr-retrieval``: the one command-line entry point.

    gtr-retrieval up                  start the local stack, ingest the default corpus, serve
    gtr-retrieval ingest FILE         upsert a corpus (BEIR corpus.jsonl or plain JSONL)
    gtr-retrieval search "text"       print the hits as a table
    gtr-retrieval get ID | delete ID  read or remove documents
    gtr-retrieval corpus stdlib       write the embedded default corpus as JSONL
    gtr-retrieval redis migrate       rewrite an old Redis key layout (also: redis layout)
    gtr-retrieval gateway serve       run the gateway (also: index serve, rerank serve)
    gtr-retrieval encoder|index|rerank ...   model export, index training, reranker training
    gtr-retrieval eval --data DIR     nDCG@10 / Recall@100 / MRR@10 of exact, IVF-PQ, rerank
    gtr-retrieval plan --docs N --qps Q   shards, replicas, GPUs, cores, memory (arithmetic shown)

Every subcommand has --help.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from services.cli import (
        client_commands,
        corpus_commands,
        drift_commands,
        encoder_commands,
        eval_commands,
        gateway_commands,
        generation_commands,
        index_commands,
        plan_commands,
        redis_commands,
        rerank_commands,
        stack_commands,
        tune_commands,
    )

    parser = argparse.ArgumentParser(
        prog="gtr-retrieval",
        description="GTR retrieval service: GTR encoder on Triton, sharded FAISS IVF-PQ, "
        "CELI rerank, gRPC gateway.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    stack_commands.add_cli(sub)
    client_commands.add_cli(sub)
    corpus_commands.add_cli(sub)
    redis_commands.add_cli(sub)
    gateway_commands.add_cli(sub)
    index_commands.add_cli(sub)
    drift_commands.add_cli(sub)  # index drift-watch, index await-generation
    generation_commands.add_cli(sub)  # index rollout, rollback, retire, generations
    encoder_commands.add_cli(sub)
    rerank_commands.add_cli(sub)
    eval_commands.add_cli(sub)
    plan_commands.add_cli(sub)
    tune_commands.add_cli(sub)
    return parser


def pin_early(argv: Sequence[str]) -> bool:
    """``index rollout --cpus C``: this process on its CPU budget before the command
    modules are imported (building the parser imports ~0.3 s of them), not from its
    handler on: the rollout's first CPU-second went to serving's CPUs before (a pooled
    bench segment, docs/generations.md "The rollout's CLI on its budget from its start").
    True when pinned; a bad or absent spec pins nothing (the handler refuses it as before)."""
    args = list(argv)
    if args[:2] != ["index", "rollout"]:
        return False
    spec = next(
        (
            nxt if arg == "--cpus" else arg.partition("=")[2]
            for arg, nxt in zip(args, [*args[1:], ""], strict=True)
            if arg == "--cpus" or arg.startswith("--cpus=")
        ),
        "",
    )
    if not spec or not hasattr(os, "sched_setaffinity"):
        return False
    from services.common.errors import InvalidArgument
    from services.process.cpus import budget_for

    try:
        os.sched_setaffinity(0, budget_for(spec))  # one thread yet: the whole process
    except (InvalidArgument, OSError):
        return False
    yield_cpus()
    return True


def yield_cpus() -> None:
    """This process's session (when it leads one) and its threads at the least weight
    (:mod:`services.process.priority`): serving takes the budget's CPUs whenever it wakes
    on them. Before any thread is started, so every thread inherits the nice."""
    import time

    from services.process import priority

    if not priority.yield_enabled():
        return
    if priority.autogroup_enabled() and priority.leads_session(os.getpid()):
        for _ in range(20):  # the kernel's 100 ms between two changes of any autogroup
            if priority.set_group_nice(os.getpid(), priority.YIELD_NICE) is not None:
                break
            time.sleep(0.05)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, priority.YIELD_NICE)


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # run as the program
        pin_early(sys.argv[1:])
    parser = build_parser()
    # `<service> serve` passes every flag on to the service's settings class (which
    # prints its own --help); other commands accept no unknown flags.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.settings = extra
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed, for records
    handler = getattr(args, "handler", None) or getattr(args, "func", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        code = int(handler(args) or 0)
    except KeyboardInterrupt:
        code = 130
    if argv is None and getattr(args, "exit_at_once", False):
        exit_at_once(code)
    return code


def exit_at_once(code: int) -> None:
    """End this process now, its output flushed, without the interpreter's teardown.

    For a command run as the program (``argv`` None) that sets ``exit_at_once``: `index
    rollout`'s teardown of torch, ONNX Runtime and faiss took 1.6 s of wall time and most
    of a core (a bench rollout, profiled with py-spy: native code under the main thread,
    after the last Python frame), while the new generation had just begun to serve on
    the same CPUs (docs/generations.md "The phase changes, profiled"). Everything the
    command owns is closed or in the store by then; nothing registered at exit is
    needed."""
    import contextlib
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
