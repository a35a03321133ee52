"""``gtr-retrieval up`` run as a user runs it, for the tests and benches that need the
whole local stack (Redis, Triton, the shards of every generation, the gateway), and the
CLI commands a user runs against it (``index rollout --run-dir ...``).

The stack is a child process in a session of its own; :func:`local_stack` stops it
(SIGTERM to its process group, SIGKILL if it does not stop) however the caller ends,
a SIGTERM to the caller included (it is turned into KeyboardInterrupt meanwhile, and the
CLI commands running then get a SIGTERM first).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from services.stack.children import sigterm_as_interrupt
from tests.support.processes import free_port, pythonpath

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "services.cli.main"]


def cli_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": pythonpath(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


@dataclass
class LocalStack:
    process: subprocess.Popen[bytes]
    run_dir: Path
    log: Path
    # the commands run_cli runs now (from any thread): stopped with the stack, so a
    # SIGTERM to a bench does not leave an `index rollout` retrying a Redis that is gone
    clis: set[subprocess.Popen[str]] = field(default_factory=set)

    def end_clis(self) -> None:
        """SIGTERM to the process group of every command :meth:`run_cli` runs now, waiting
        for none (a signal handler's part: the threads waiting on them then return)."""
        for cli in list(self.clis):
            if cli.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(cli.pid, signal.SIGTERM)

    def state(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "stack.json").read_text())  # type: ignore[no-any-return]

    @property
    def gateway(self) -> str:
        return str(self.state()["gateway"])

    @property
    def redis_url(self) -> str:
        """The whole URL (the run's URL file: password and certificates included)."""
        return Path(self.state()["redis_url_file"]).read_text(encoding="utf-8").strip()

    @property
    def triton_url(self) -> str:
        return str(self.state()["triton_grpc"])

    def redis(self) -> Any:
        """A blocking client on the stack's Redis (bytes replies, as the Registry takes)."""
        import redis

        return redis.Redis.from_url(self.redis_url)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.process.poll() is None

    def until(self, condition: Callable[[], bool], what: str, timeout: float) -> float:
        """Poll ``condition`` (its OSError/ValueError/KeyError count as not yet) until it
        holds; AssertionError with the stack's log when it does not, or when ``up`` exits."""
        start = time.monotonic()
        while True:
            if not self.alive():
                raise AssertionError(
                    f"gtr-retrieval up exited while waiting for {what}:\n{self.tail()}"
                )
            try:
                if condition():
                    return time.monotonic() - start
            except (OSError, ValueError, KeyError):
                pass  # stack.json between writes, a child not listed yet
            if time.monotonic() - start > timeout:
                raise AssertionError(f"not within {timeout:.0f} s: {what}\n{self.tail()}")
            time.sleep(0.1)

    # --- the CLI against this stack ---------------------------------------------------

    def command(self, *args: str) -> list[str]:
        return [*CLI, *args]

    def run_cli(
        self, *args: str, timeout: float = 600.0, log: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``gtr-retrieval <args>`` to its end (its output kept, also appended to ``log``);
        a session of its own, ended with the stack if the stack stops first."""
        proc = subprocess.Popen(
            self.command(*args),
            cwd=ROOT,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.clis.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:  # its timeout, or the caller interrupted
            _stop(proc)
            raise
        finally:
            self.clis.discard(proc)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        if log is not None:
            with log.open("a", encoding="utf-8") as fh:
                fh.write(f"$ gtr-retrieval {' '.join(args)}  (exit {done.returncode})\n")
                fh.write(done.stdout + done.stderr + "\n")
        return done

    def start_cli(self, *args: str, out: IO[bytes]) -> subprocess.Popen[bytes]:
        """``gtr-retrieval <args>`` started (a session of its own, so a kill -9 of it hits
        nothing else); its output into ``out``."""
        return subprocess.Popen(
            self.command(*args),
            cwd=ROOT,
            env=cli_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextmanager
def local_stack(
    run_dir: Path,
    log: Path,
    *,
    corpus: Path | None,
    shards: int = 2,
    replicas: int = 1,
    encoder: str = "triton",
    extra: Sequence[str] = (),
    timeout: float = 900.0,
    keep_logs: Path | None = None,
) -> Iterator[LocalStack]:
    """``gtr-retrieval up`` (no reranker, no Prometheus, the gateway on a free port) until
    it says it serves: the corpus ingested and the example searches answered.
    ``keep_logs``: copy the children's logs and up's own there when it stops."""
    args = [
        "up",
        "--run-dir",
        str(run_dir),
        "--shards",
        str(shards),
        "--replicas",
        str(replicas),
        "--encoder",
        encoder,
        "--no-rerank",
        "--no-prometheus",
        "--port",
        str(free_port()),
        "--http-port",
        "0",
        *(["--corpus", str(corpus)] if corpus is not None else []),
        *extra,
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    started: list[LocalStack] = []

    def end_clis() -> None:
        for stack in started:
            stack.end_clis()

    # SIGTERM to the caller (a bench under `timeout`) stops the stack as Ctrl-C does; the
    # CLIs first: a bench waits for `index rollout` in a thread (asyncio.to_thread), and
    # asyncio.run waits for that thread before the `finally` below can stop anything
    with sigterm_as_interrupt(end_clis):
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [*CLI, *args],
                cwd=ROOT,
                env=cli_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        stack = LocalStack(proc, run_dir, log)
        started.append(stack)
        try:
            stack.until(
                lambda: "[up] serving" in log.read_text(errors="replace"), "up serving", timeout
            )
            yield stack
        finally:
            for cli in list(stack.clis):
                _stop(cli)
            _stop(proc)
            if keep_logs is not None:
                import shutil

                shutil.copytree(run_dir / "logs", keep_logs / "logs", dirs_exist_ok=True)
                shutil.copy2(log, keep_logs / log.name)


def small_corpus(source: Path, path: Path, docs: int, text_chars: int = 400) -> list[str]:
    """The first ``docs`` documents of a BEIR ``corpus.jsonl`` (texts cut to
    ``text_chars``) written to ``path``; their ids."""
    ids: list[str] = []
    lines: list[str] = []
    with (source / "corpus.jsonl").open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            row["text"] = row["text"][:text_chars]
            lines.append(json.dumps(row))
            ids.append(str(row["_id"]))
            if len(ids) == docs:
                break
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return ids


def queries(source: Path, n: int = 200) -> list[str]:
    out: list[str] = []
    with (source / "queries.jsonl").open(encoding="utf-8") as fh:
        for line in fh:
            out.append(str(json.loads(line)["text"]))
            if len(out) == n:
                break
    return out
