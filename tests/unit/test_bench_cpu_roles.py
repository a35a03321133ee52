"""bench/cpu_roles.py: the cores each role of a stack used in a window, from /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cpu_roles
from tests.support.processes import wait_until


def test_a_windows_cores_are_cpu_seconds_over_wall_seconds_between_its_samples() -> None:
    samples = [
        (0.0, {"gateway": 1.0, "machine": 10.0}),
        (1.0, {"gateway": 1.5, "machine": 11.0}),
        (3.0, {"gateway": 2.5, "machine": 14.0, "builder": 4.0}),
        (9.0, {"gateway": 9.0, "machine": 30.0, "builder": 5.0}),
    ]
    # inside [0.5, 3.0]: the samples at 1 and 3; a role first seen late counts from 0
    assert cpu_roles.cores(samples, 0.5, 3.0) == {
        "builder": 2.0,
        "gateway": 0.5,
        "machine": 1.5,
        "other": 0.0,  # the machine's busy time is less than the roles' (rounding): none
    }
    assert cpu_roles.cores(samples, 3.0, 9.0)["other"] == pytest.approx(8.5 / 6, abs=1e-3)
    assert cpu_roles.cores(samples, 2.0, 4.0) == {}  # one sample: no window


def test_a_window_shorter_than_the_samples_gets_its_share_read_between_them() -> None:
    samples = [
        (0.0, {"gateway": 0.0, "machine": 0.0}),
        (1.0, {"gateway": 0.4, "machine": 1.0, "shards g3": 0.5}),
        (2.0, {"gateway": 0.6, "machine": 1.8, "shards g3": 0.3}),  # a process of it ended
    ]
    used = cpu_roles.seconds_used(samples, 0.25, 0.75)  # between two samples
    assert used == {  # a role first seen at 1 counts from 0 at the sample before
        "gateway": pytest.approx(0.2),
        "machine": pytest.approx(0.5),
        "shards g3": pytest.approx(0.25),
    }
    used = cpu_roles.seconds_used(samples, 0.5, 1.5)
    assert used["gateway"] == pytest.approx(0.3) and used["machine"] == pytest.approx(0.9)
    assert used["shards g3"] == pytest.approx(0.15)
    assert cpu_roles.seconds_used(samples, 1.0, 2.0)["shards g3"] == 0.0  # went down
    assert cpu_roles.seconds_used(samples, 1.5, 2.5) == {}  # past the last sample


def test_the_timeline_names_the_roles_that_used_a_tenth_of_a_core_in_each_bucket() -> None:
    samples = [
        (10.0, {"gateway": 0.0, "builder": 0.0, "redis": 0.0, "machine": 0.0, "steal": 0.0}),
        (11.0, {"gateway": 0.2, "builder": 0.0, "redis": 0.05, "machine": 0.3, "steal": 0.0}),
        (12.0, {"gateway": 0.4, "builder": 0.9, "redis": 0.1, "machine": 1.5, "steal": 0.1}),
        (13.0, {"gateway": 0.6, "builder": 1.8, "redis": 0.15, "machine": 2.6, "steal": 0.1}),
    ]
    rows = cpu_roles.timeline(samples, origin=10.0, bucket_s=2.0).splitlines()
    # a bucket holds the samples at both its ends: [10, 12] reads 10, 11 and 12 s
    words = [" ".join(row.split()) for row in rows]
    # redis (0.05 of a core) is left out
    assert words[0] == "0s machine 0.75 steal 0.05: builder 0.45, gateway 0.20"
    assert words[1] == "2s machine 1.10 steal 0.00: builder 0.90, gateway 0.20"
    assert len(rows) == 2


def test_the_hypervisors_steal_is_not_another_jobs_load() -> None:
    """/proc/stat counts steal as busy: it is reported apart, not as ``other``."""
    used = {"gateway": 0.5, "machine": 1.0, "steal": 0.4}
    assert cpu_roles.with_other(used)["other"] == pytest.approx(0.1)
    assert cpu_roles.machine_steal_s() >= 0.0
    assert "steal" in cpu_roles.sample(os.getpid())


def test_the_roles_of_real_processes_come_from_their_command_lines() -> None:
    cmd = [sys.executable, "-c", "import time; time.sleep(30)", "index", "serve"]
    proc = subprocess.Popen([*cmd, "--generation", "g2"])
    try:
        # its command line shows once the child has exec'd
        wait_until(lambda: cpu_roles.role(proc.pid, os.getpid()) == "shards g2", "its role")
        assert cpu_roles.role(os.getpid(), os.getpid()) == "client"
        used = cpu_roles.sample(os.getpid())
        assert "shards g2" in used and used["machine"] > 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("gone", [2**22 + 7])
def test_a_process_that_is_gone_has_no_role_worth_counting(gone: int) -> None:
    assert cpu_roles.role(gone, os.getpid()) == "gone"


def test_a_forked_shard_is_named_from_the_stacks_children(tmp_path: Path) -> None:
    """``up`` forks its shards from a fork server: their command line is the server's,
    and until 2026-12-02 they were counted as the bench's ``client``."""
    forked = "from multiprocessing.forkserver import main; import time; time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", forked])
    stack = tmp_path / "stack.json"
    try:
        wait_until(lambda: cpu_roles.role(proc.pid, os.getpid()) == "shards", "its role")
        stack.write_text(
            json.dumps({"children": [{"name": "g3-shard-1-replica-0", "pid": proc.pid}]})
        )
        named = cpu_roles.stack_children(str(stack))
        assert cpu_roles.role(proc.pid, os.getpid(), named) == "shards g3"
        with cpu_roles.RoleCpu(os.getpid(), every_s=0.05, stack_file=stack) as cpu:
            pass  # entered: its first sample is taken
        assert "shards g3" in cpu.samples[0][1]  # the sampler's own process read the file
    finally:
        proc.kill()
        proc.wait()
    assert cpu_roles.role(1, 0, {1: "shard-0-replica-0"}) == "shards g1"
    assert cpu_roles.role(1, 0, {1: "gateway"}) == "gateway"
    assert cpu_roles.stack_children(str(tmp_path / "none.json")) == {}
    assert cpu_roles.stack_children(None) == {}
