"""``gtr-retrieval up`` in a child process for a benchmark, on a corpus cut from BEIR.

Used by :mod:`loadtest.stack_report` and :mod:`bench.query_path`: the stack comes up as a
user starts it, is measured while it serves, and stops with its children on the way out.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

SHARDS = 2


@contextmanager
def local_stack(
    run_dir: Path, timeout_s: float, corpus: Path | None, extra: tuple[str, ...] = ()
) -> Iterator[Path]:
    """``gtr-retrieval up`` in a child process until it serves; yields its stack.json."""
    cmd = [
        sys.executable,
        "-m",
        "services.cli.main",
        "up",
        "--run-dir",
        str(run_dir),
        "--port",
        "0",
        "--shards",
        str(SHARDS),
    ]
    if corpus is not None:
        cmd += ["--corpus", str(corpus)]
    cmd += extra
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:
            if line.startswith("[up]"):
                print("  " + line.rstrip(), flush=True)
            if "[up] serving" in line:
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the stack did not come up (last line: {line.strip()!r})")
        else:
            raise RuntimeError(f"the stack exited with {proc.wait()} before serving")
        # Keep reading its output: a full pipe would block the stack mid-measurement.
        threading.Thread(target=_discard, args=(proc.stdout,), daemon=True).start()
        yield run_dir / "stack.json"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def write_corpus(source: Path, path: Path, docs: int) -> Path:
    """The first ``docs`` documents of the BEIR ``corpus.jsonl`` in ``source``, as ``path``."""
    with (source / "corpus.jsonl").open(encoding="utf-8") as fh, path.open("w") as out:
        for n, line in enumerate(fh):
            if n == docs:
                break
            out.write(line)
    return path


def _discard(stream: IO[str]) -> None:
    for _ in stream:
        pass
