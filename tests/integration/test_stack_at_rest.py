"""Issue #33 points 3 and 6 on one real ``gtr-retrieval up --auth`` (one shard, the
in-process encoder, 400 SciFact documents), started the way the benches start it
(``tests/support/local_stack.py``) in a helper process of its own:

- at rest: every directory of the run directory is 0700 and every file 0600 (Redis's AOF
  and RDB, the shard's snapshots, the trained index, the logs, the auth files); before,
  the directories were 0755 and the AOF and snapshots 0644, readable by any local user
  whatever the bearer tokens;
- SIGTERM to the helper (a bench under ``timeout``) stops ``up`` and every child it
  recorded in ``<run-dir>/stack.json``; before, the helper died at once and the whole
  stack, in sessions of its own, kept running. The helper waits, as ``bench.rollout``
  waits for ``index rollout``, for a CLI command in a thread of ``asyncio.run`` (here
  ``index drift-watch``, which runs until stopped): that command ends too, and at once;
  before (2026-12-02), ``asyncio.run`` waited for the thread, the thread for the command,
  and a bench under ``timeout`` kept its stack running until its rollout ended.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.process.cpus import children_of, cmdline, running
from tests.support.local_stack import ROOT, cli_env, small_corpus
from tests.support.private_files import not_private
from tests.support.processes import redis_binary

HELPER = """
import asyncio, sys
from pathlib import Path
from tests.support.local_stack import local_stack

run_dir, log, corpus = (Path(a) for a in sys.argv[1:4])
with local_stack(
    run_dir, log, corpus=corpus, shards=1, encoder="inprocess", extra=["--auth"], timeout=600
) as stack:
    print(stack.process.pid, flush=True)
    watch = ["index", "drift-watch", "--run-dir", str(run_dir), "--threshold", "1000",
             "--window", "1h", "--interval", "3600"]
    asyncio.run(asyncio.to_thread(stack.run_cli, *watch, timeout=3600))
"""


def _until(condition: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.05)


def _drift_watch(helper: int) -> list[int]:
    """The ``index drift-watch`` the helper (pid ``helper``) runs: its child whose
    command line names it."""
    return [pid for pid in children_of(helper) if "drift-watch" in cmdline(pid)]


@pytest.mark.slow
def test_up_keeps_its_data_private_and_a_sigterm_to_its_starter_stops_every_child(
    tmp_path: Path, scifact_dir: Path
) -> None:
    if redis_binary() is None:
        pytest.fail("redis-server is not installed (scripts/bootstrap.sh installs it)")
    corpus = tmp_path / "corpus" / "corpus.jsonl"
    corpus.parent.mkdir()
    small_corpus(scifact_dir, corpus, 300, text_chars=120)  # what is checked: files, signals
    run_dir, log = tmp_path / "run", tmp_path / "up.log"
    helper = subprocess.Popen(
        [sys.executable, "-c", HELPER, str(run_dir), str(log), str(corpus)],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        assert helper.stdout is not None
        line = helper.stdout.readline()  # up's pid once it serves; "" if the helper died
        assert line.strip(), log.read_text(errors="replace")[-4000:] if log.exists() else ""
        state = json.loads((run_dir / "stack.json").read_text())
        pids = [int(line), *(int(c["pid"]) for c in state["children"] if c["pid"])]
        names = {c["name"] for c in state["children"]}
        assert {"redis", "shard-0-replica-0", "gateway"} <= names, names

        # at rest: the AOF, the snapshots, the index, logs and secrets are the owner's only
        assert any((run_dir / "redis").rglob("*.aof")), sorted((run_dir / "redis").rglob("*"))
        assert (run_dir / "auth" / "write.tokens").exists()
        assert not_private(run_dir) == []
        _until(lambda: bool(_drift_watch(helper.pid)), "the helper's drift-watch running", 60)
        pids += _drift_watch(helper.pid)

        os.kill(helper.pid, signal.SIGTERM)  # as `timeout` ends a bench
        try:
            helper.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail("the helper still waits for its CLI command 60 s after SIGTERM")
        _until(lambda: not any(running(p) for p in pids), f"{pids} gone after SIGTERM", 60)
        # the shard's snapshot on its way out (and the AOF's final state) as private
        assert any((run_dir / "snapshots").rglob("*.npz")), "no snapshot written at stop"
        assert not_private(run_dir) == []
    finally:
        for pid in [helper.pid, *pids]:
            if running(pid):
                os.killpg(pid, signal.SIGKILL)  # the test failed: leave nothing running
        helper.wait(30)
