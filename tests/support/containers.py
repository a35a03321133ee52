"""Containers from the images scripts/build_images.sh builds, run here without a daemon.

``buildah from`` makes a working container of an image and ``buildah run --isolation
chroot --network host`` runs a command in it as the image's user with the host's network
(so servers listen on free loopback ports, as the other tests' servers do). Each command
runs in a process group of its own, so stopping it reaches whatever it started. With
Docker (a daemon that answers) ``docker run --network host`` does the same.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build_images.sh"
# As scripts/build_images.sh: the STORAGE_DRIVER environment variable (buildah's global
# --storage-driver flag selects another store than the one the script builds into).
BUILDAH_ENV = {**os.environ, "STORAGE_DRIVER": os.environ.get("BUILDAH_STORAGE_DRIVER", "vfs")}


def docker_works() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


def image_refs() -> dict[str, str]:
    """``{"APP": ..., "TRITON_CPU": ..., ...}`` as the build script names the images."""
    out = subprocess.run(
        [str(BUILD_SCRIPT), "--print"], capture_output=True, text=True, check=True
    ).stdout
    return dict(line.split("=", 1) for line in out.split())


@dataclass
class Container:
    """One working container of ``image``; ``start`` runs a command in it."""

    image: str
    name: str = ""
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    docker: bool = False
    docker_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.docker:
            self.name = subprocess.run(
                ["buildah", "from", "--pull-never", "--quiet", self.image],
                capture_output=True,
                text=True,
                check=True,
                env=BUILDAH_ENV,
            ).stdout.strip()

    def command(
        self,
        argv: Sequence[str],
        *,
        volumes: dict[Path, str] | None = None,
        env: dict[str, str] | None = None,
        entrypoint: bool = True,
    ) -> list[str]:
        """The command line that runs ``argv`` (after the image's entrypoint) in the container."""
        mounts = [f"{host}:{inside}" for host, inside in (volumes or {}).items()]
        if self.docker:
            self.docker_names.append(f"gtr-test-{uuid.uuid4().hex[:12]}")
            cmd = ["docker", "run", "--rm", "--name", self.docker_names[-1], "--network", "host"]
            cmd += [a for m in mounts for a in ("-v", m)]
            cmd += [a for k, v in (env or {}).items() for a in ("-e", f"{k}={v}")]
            if not entrypoint:
                cmd += ["--entrypoint", argv[0]]
                argv = argv[1:]
            return [*cmd, self.image, *argv]
        cmd = [
            "env",
            f"STORAGE_DRIVER={BUILDAH_ENV['STORAGE_DRIVER']}",
            "buildah",
            "run",
            "--isolation",
            "chroot",
            "--network",
            "host",
        ]
        cmd += [a for m in mounts for a in ("-v", m)]
        cmd += [a for k, v in (env or {}).items() for a in ("--env", f"{k}={v}")]
        # buildah run does not prepend the entrypoint; the image's is the first word.
        prefix = self.entrypoint() if entrypoint else []
        return [*cmd, self.name, "--", *prefix, *argv]

    def config(self) -> dict[str, object]:
        """The image's Docker config (Entrypoint, User, Healthcheck, Labels...)."""
        out = subprocess.run(
            ["buildah", "inspect", "--type", "image", self.image],
            capture_output=True,
            text=True,
            check=True,
            env=BUILDAH_ENV,
        ).stdout
        config: dict[str, object] = json.loads(out)["Docker"]["config"]
        return config

    def entrypoint(self) -> list[str]:
        return [str(word) for word in self.config().get("Entrypoint") or []]  # type: ignore[attr-defined]

    def run(self, argv: Sequence[str], timeout: float, **kwargs: object) -> str:
        """Run to completion; the output, or CalledProcessError with it."""
        proc = subprocess.run(
            self.command(argv, **kwargs),  # type: ignore[arg-type]
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
                f"\n{proc.stderr[-3000:]}"
            )
        return proc.stdout

    def start(self, argv: Sequence[str], log: Path, **kwargs: object) -> subprocess.Popen[bytes]:
        """Start a long-running command (a server); its output goes to ``log``."""
        with log.open("wb") as out:
            proc = subprocess.Popen(
                self.command(argv, **kwargs),  # type: ignore[arg-type]
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(proc)
        return proc

    def remove(self) -> None:
        for name in self.docker_names:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
        for proc in self.processes:
            stop_group(proc)
        if not self.docker and self.name:
            subprocess.run(
                ["buildah", "rm", self.name], capture_output=True, check=False, env=BUILDAH_ENV
            )


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``timeout``."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            continue
