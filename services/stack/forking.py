"""Shard processes forked from one that imported their libraries once (the stack's fork
server; docs/generations.md "Shard processes forked, not exec'd").

A shard replica started as a fresh interpreter spends ~0.5 s of user and ~0.2 s of
system CPU importing what it needs (grpc, faiss, numpy, redis-py, pydantic-settings,
tantivy, prometheus-client) before it reads its first log entry. During a rollout its
target's shards start on the rollout's CPU while serving goes on beside it, and on a
small corpus that start was the largest part of a retrain's work. So the local stack
starts its shard processes through Python's ``forkserver``: one process, started with
the stack, imports :data:`PRELOAD` once; every shard process is a fork of it that runs
``gtr-retrieval index serve`` with its own argv, environment, log file and CPUs. Nothing
but imports happens in the server before it forks (no thread of ours, no gRPC channel,
no Redis connection, no OpenMP region), which is what makes the fork safe.

:class:`ForkedProcess` gives a forked child the surface of :class:`subprocess.Popen` the
supervisor uses (``pid``, ``poll``, ``wait``, ``returncode``), so a forked shard is
supervised, restarted, pinned and stopped as an exec'd one is; like an exec'd child it
leads a session of its own (``os.setsid``), so Ctrl-C reaches ``up`` only and a
``killpg`` of its pid reaches it. ``up --no-fork-shards`` starts them exec'd.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import select
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import connection
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path

# What a forked child runs: the CLI's main, given ``gtr-retrieval``'s arguments.
CLI_MAIN = "services.cli.main:main"
# What a shard process imports: the CLI's command modules (its parser builds from every
# one) and the shard server's module, whose imports are the libraries above. A module
# missing here is imported by each child (slower, not wrong). Not ``services.cli.main``
# itself (a few imports of the standard library): when ``up`` runs as ``python -m
# services.cli.main``, multiprocessing runs that module again in each child as
# ``__mp_main__``, and runpy warns on stderr (up's) when it was imported already.
PRELOAD = (
    "services.cli.client_commands",
    "services.cli.corpus_commands",
    "services.cli.drift_commands",
    "services.cli.encoder_commands",
    "services.cli.eval_commands",
    "services.cli.gateway_commands",
    "services.cli.generation_commands",
    "services.cli.index_commands",
    "services.cli.plan_commands",
    "services.cli.redis_commands",
    "services.cli.rerank_commands",
    "services.cli.stack_commands",
    "services.cli.tune_commands",
    "services.index.server.process",
)


# A child's exit status is one message from the fork server, read once from its
# sentinel: two threads reading it at once (the supervisor's monitor polling, a stop
# waiting, multiprocessing's own clean-up of finished children when another child
# starts) would leave one of them an EOF, which multiprocessing reports as exit code 255.
# Every read and every start holds this lock.
_STATUS = threading.Lock()
# The exit code of a child whose fork server died before reporting it (multiprocessing's
# own stand-in for a status it could not read).
UNKNOWN_EXIT = 255
# How long an ended child's status may take to arrive from its fork server (it reaps,
# then writes it).
REPORT_S = 1.0


class ForkedProcess:
    """A child forked by the fork server, seen as a :class:`subprocess.Popen`.

    Whether it runs is asked of the kernel (a pidfd, readable once the process has
    ended), not of the fork server: the server reports exit statuses, and a server that
    died (a SIGTERM to ``up``'s whole process group reaches it: the shards lead sessions
    of their own) makes multiprocessing report every child as ended with 255, the
    children running on. Taken for ended, they were never stopped: ``up`` left them
    running when it exited (found 2026-12-01, a bench stopping its stack that way). Only
    the exit *code* comes from the server; without one it is :data:`UNKNOWN_EXIT`."""

    def __init__(self, process: BaseProcess, args: Sequence[str]) -> None:
        self._process = process
        self.args = list(args)
        pid = process.pid
        assert pid is not None  # started
        self.pid: int = pid
        self.returncode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # ended (and reaped) already
            self._pidfd = None

    def __del__(self) -> None:
        # closed with the object, not once ended: a wait in another thread may be
        # selecting on it (a number closed there could be another file's by then)
        pidfd = getattr(self, "_pidfd", None)
        if pidfd is not None:
            os.close(pidfd)
            self._pidfd = None

    def _ended(self, timeout: float | None) -> bool:
        if self._pidfd is None:
            return True
        ready, _, _ = select.select([self._pidfd], [], [], timeout)
        return bool(ready)

    def poll(self) -> int | None:
        with _STATUS:
            if self.returncode is None and self._ended(0):
                code = self._process.exitcode  # reported by the fork server
                if code is None:  # ended a moment ago: the report is on its way
                    connection.wait([self._process.sentinel], REPORT_S)
                    code = self._process.exitcode
                self.returncode = UNKNOWN_EXIT if code is None else code
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._ended(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code


class ForkServer:
    """The stack's fork server: :meth:`start` it (it imports :data:`PRELOAD` in the
    background), :meth:`spawn` shard processes from it. Python allows one per process;
    this object is its handle in ``up``."""

    def __init__(self, preload: Sequence[str] = PRELOAD, entry: str = CLI_MAIN) -> None:
        self._ctx: ForkServerContext = multiprocessing.get_context("forkserver")  # type: ignore[assignment]
        self._preload = list(preload)
        self._entry = entry  # "module:function", called with the child's argv

    def start(self) -> None:
        """Start the server (its imports go on in the background: the first
        :meth:`spawn` waits for them). Its umask and environment are this process's now:
        every child gets its own from :meth:`spawn` all the same."""
        self._ctx.set_forkserver_preload(self._preload)
        from multiprocessing import forkserver

        forkserver.ensure_running()

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        cpus: frozenset[int] | None = None,
    ) -> ForkedProcess:
        """Fork a child that runs ``gtr-retrieval argv[3:]`` (``argv``: an exec'd child's,
        ``python -m services.cli.main ...``) with ``env``, its output appended to
        ``log_path``, on ``cpus`` (None: this process's)."""
        umask = current_umask()
        process = self._ctx.Process(
            target=run_child,
            args=(self._entry, list(argv[3:]), dict(env), str(log_path), cpus, umask),
            name=log_path.stem,
            daemon=True,  # up's exit ends it (SIGTERM), as it stops every child
        )
        with _STATUS:  # its clean-up polls the children that ended
            process.start()
        return ForkedProcess(process, argv)


def current_umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``): setting it
    to read it back would leave it 0 for a moment in which another thread of ``up`` may
    create a file open to everyone. Where ``/proc`` does not say, the set-and-restore."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o077)  # the strictest for the moment it is read
    os.umask(umask)
    return umask


def run_child(
    entry: str,
    argv: list[str],
    env: dict[str, str],
    log_path: str,
    cpus: frozenset[int] | None,
    umask: int,
) -> None:
    """In the forked child: a session of its own, its CPUs and umask, stdin from
    /dev/null and output to its log, its environment; then ``entry`` (the CLI's main)
    with ``argv``. Its exit code is what that returns (``SystemExit``, which the fork
    server reports)."""
    os.setsid()
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.umask(umask)
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["gtr-retrieval", *argv]
    module, _, function = entry.partition(":")
    main = getattr(importlib.import_module(module), function)
    sys.exit(main(argv))
