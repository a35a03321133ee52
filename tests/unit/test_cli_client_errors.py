"""The client commands answer an operator's mistake with one ``error:`` line and an exit
status a script can branch on, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_ingest_of_a_file_that_is_not_there_is_one_error_line_exit_2(tmp_path: Path) -> None:
    """It fails before any gateway is reached (the address given answers nothing)."""
    missing = tmp_path / "no-such-corpus.jsonl"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "ingest",
            str(missing),
            "--gateway",
            "127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert run.stderr.startswith("error: ") and str(missing) in run.stderr, run.stderr
