"""What a child forked by the stack's fork server sees (``tests/unit/test_fork_server.py``):
an entry point (``tests.support.fork_probe:main``) that prints it to its output, then
exits with the code its first argument names, or waits to be killed (``wait``)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    print(
        json.dumps(
            {
                "argv": list(argv),
                "sys_argv": sys.argv,
                "probe": os.environ.get("GTR_FORK_PROBE"),
                "cpus": sorted(os.sched_getaffinity(0)),
                "umask": os.umask(0o022),
                "session_leader": os.getsid(0) == os.getpid(),
                "group_leader": os.getpgid(0) == os.getpid(),
                "stdin": os.readlink("/proc/self/fd/0"),
            }
        ),
        flush=True,
    )
    if argv and argv[0] == "wait":
        while True:
            time.sleep(60)
    return int(argv[0]) if argv else 0
