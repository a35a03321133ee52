"""Run NVIDIA Triton Inference Server from the ``nvidia-pytriton`` wheel, without a container.

The wheel ships ``pytriton/tritonserver/bin/tritonserver``, the Python backend
(``backends/python/``) and one backend stub per Python version
(``python_backend_stubs/<X.Y>/triton_python_backend_stub``). What it takes to load a
standard model repository with it:

1. One backend folder ``<dir>/python/`` holding ``libtriton_python.so``,
   ``triton_python_backend_utils.py`` and the stub of the *running* Python, passed as
   ``--backend-directory=<dir>``.
2. ``LD_LIBRARY_PATH=<sys.base_prefix>/lib:<site-packages>/nvidia_pytriton.libs``:
   the stub links ``libpython3.X.so.1.0``. Its RPATH only works inside the wheel, and
   a system libpython (``/lib/x86_64-linux-gnu``) would run against a different stdlib
   than this interpreter's; so this interpreter's own ``lib/`` comes first.
3. ``PATH=<venv>/bin:$PATH``. The stub embeds Python and ignores ``PYTHONPATH``; it
   derives ``sys.prefix`` from the first ``python3`` on ``PATH``. With the virtualenv's
   ``bin/`` first, the models run inside this virtualenv (its ``pyvenv.cfg`` is found,
   its site-packages and ``.pth`` files are used) and import the same numpy,
   onnxruntime and tokenizers as the service; otherwise they get the base
   interpreter's site-packages (here: a numpy 2.x next to the venv's 1.26).

``triton_command`` builds the command and environment (the local stack launcher uses
it); ``run_triton`` starts the server, waits until ``embed`` is ready and stops it.

Model control: explicit (``--model-control-mode=explicit --load-model=*``). At start the
server loads every model of the repository, as the default mode does; afterwards it
changes what it serves only when asked (``RepositoryModelLoad``): ``encoder publish``
(``services/encoder/serve/publish.py``) adds an encoder version to the repository and
asks the running server to load it beside the serving ones, with no restart and no gap
(docs/encoder.md "Several encoder versions"). ``TritonServerConfig.model_control =
"none"`` starts it as before (the repository read once at start, load requests refused).

Stopping: tritonserver handles SIGTERM and SIGINT ("Signal (15) received"; neither
needs SIGKILL): it stops taking requests, waits for the in-flight inferences, unloads
the models and exits 0. Its Python backend stubs (its children, in its process group,
so a ``killpg`` reaches them too) catch SIGTERM and SIGINT and ignore them; they end
when the server unloads their model. Triton checks its shutdown countdown once a
second, so an idle server exits ~2.5 s after SIGTERM. What can keep it longer is work:

* requests of a client that is still connected are all executed before the process
  exits, even after ``--exit-timeout-secs`` has expired ("Exiting immediately" is not);
  measured: 12 clients sending batches of 64 documents kept it busy past any grace;
* requests of a client that has gone (the gateway stopped first, as ``gtr-retrieval
  up`` does) are cancelled: queued ones leave the queue, and the ``embed`` model answers
  them CANCELLED without running them, checking between pieces of 16 rows, so the batch
  in hand stops within one piece; then the model unloads: 3–4 s after SIGTERM under
  that load on 2 cores (running the whole 64-document batch for nobody took past the
  8 s below on a shared machine, and the server exited 1).

``--exit-timeout-secs`` (default 30 s) bounds the wait for in-flight inferences and the
unload; 30 s is longer than the 10 s a supervisor gives a child before SIGKILL, so a
server told to stop while still busy used to be SIGKILLed with its models loaded.
``exit_timeout_s = 8`` keeps that wait inside the grace and leaves room for the ~5 s a
busy server needs to finish the batch in hand and unload (3 s was too short there: the
unload was cut and the server exited 1).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from services.common.errors import FailedPrecondition, Unavailable

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS


@dataclass(frozen=True)
class TritonServerConfig:
    """Where the repository is, which ports, which model must be ready."""

    model_repository: Path
    grpc_port: int = 8001
    http_port: int = 8000
    metrics_port: int = 8002
    host: str = "127.0.0.1"
    backend_dir: Path | None = None  # None: a per-user folder under the temp dir
    ready_model: str = "embed"
    startup_timeout_s: float = 120.0
    stop_timeout_s: float = 20.0
    # --exit-timeout-secs: how long a stopping server waits for in-flight inferences and
    # the unload; below stop_timeout_s and the local stack's 10 s grace (see the docstring).
    exit_timeout_s: int = 8
    log_verbose: int = 0
    extra_args: tuple[str, ...] = ()
    # Triton's HTTP/REST endpoint. It has no TLS and no authentication of its own (the
    # gRPC flags do not cover it): False closes it (--allow-http=false), as the local
    # stack does; readiness is asked over gRPC either way (:func:`model_ready`).
    http: bool = True
    # "explicit": every model loaded at start, and encoder publish's load requests
    # honoured (a new encoder version served without a restart); "none": read once
    model_control: Literal["explicit", "none"] = "explicit"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def pytriton_root() -> Path:
    """``<site-packages>/pytriton/tritonserver``, or FailedPrecondition naming the fix."""
    root = site_packages() / "pytriton" / "tritonserver"
    if not (root / "bin" / "tritonserver").exists():
        raise FailedPrecondition(
            f"tritonserver not found under {root}: pip install nvidia-pytriton (Linux x86_64)"
        )
    return root


def prepare_backend_dir(dest: Path | None = None) -> Path:
    """Assemble ``<dest>/python/`` (library, utils, this Python's stub); idempotent."""
    root = pytriton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise FailedPrecondition(f"the wheel has no Python backend stub for Python {version}")
    dest = Path(dest or Path(tempfile.gettempdir()) / f"gtr-triton-backends-{os.getuid()}")
    target = dest / "python"
    target.mkdir(parents=True, exist_ok=True)
    for src in (
        root / "backends" / "python" / "libtriton_python.so",
        root / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ):
        dst = target / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size:
            shutil.copy2(src, dst)
    return dest


def triton_env_overrides(cfg: TritonServerConfig) -> dict[str, str]:
    """Only the variables the server needs on top of the caller's environment."""
    libs = [str(Path(sys.base_prefix) / "lib"), str(site_packages() / "nvidia_pytriton.libs")]
    if os.environ.get("LD_LIBRARY_PATH"):
        libs.append(os.environ["LD_LIBRARY_PATH"])
    # sys.executable is <venv>/bin/python (a symlink: do not resolve it).
    path = [str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")]
    return {
        "LD_LIBRARY_PATH": ":".join(libs),
        "PATH": ":".join(path),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def triton_command(cfg: TritonServerConfig) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` to start tritonserver; env is the *complete* environment for Popen.

    Side effect: assembles the Python backend folder (see :func:`prepare_backend_dir`).
    """
    backend_dir = prepare_backend_dir(cfg.backend_dir)
    argv = [
        str(pytriton_root() / "bin" / "tritonserver"),
        f"--model-repository={Path(cfg.model_repository).resolve()}",
        f"--backend-directory={backend_dir}",
        f"--grpc-port={cfg.grpc_port}",
        f"--metrics-port={cfg.metrics_port}",
        f"--grpc-address={cfg.host}",
        # else the metrics follow --http-address, and without HTTP bind 0.0.0.0
        f"--metrics-address={cfg.host}",
        *(
            [f"--http-port={cfg.http_port}", f"--http-address={cfg.host}"]
            if cfg.http
            else ["--allow-http=false"]
        ),
        "--allow-gpu-metrics=false",
        f"--model-control-mode={cfg.model_control}",
        *(["--load-model=*"] if cfg.model_control == "explicit" else []),
        "--exit-on-error=true",
        "--strict-readiness=true",
        f"--exit-timeout-secs={cfg.exit_timeout_s}",
        f"--log-verbose={cfg.log_verbose}",
        *cfg.extra_args,
    ]
    return argv, {**os.environ, **triton_env_overrides(cfg)}


def grpc_tls_args(cert: Path, key: Path, client_ca: Path | None = None) -> tuple[str, ...]:
    """tritonserver flags for TLS on its gRPC endpoint (``extra_args``), from PEM files;
    with ``client_ca`` clients must present a certificate signed by it (mTLS). They do
    not cover the HTTP endpoint, which would still answer inferences in plaintext to
    anyone: close it with ``TritonServerConfig.http = False``."""
    args = [
        "--grpc-use-ssl=true",
        f"--grpc-server-cert={Path(cert).resolve()}",
        f"--grpc-server-key={Path(key).resolve()}",
    ]
    if client_ca is not None:
        args += ["--grpc-use-ssl-mutual=true", f"--grpc-root-cert={Path(client_ca).resolve()}"]
    return tuple(args)


def trace_args(endpoint: str, ratio: float = 1.0, service: str = "triton") -> tuple[str, ...]:
    """tritonserver flags (``extra_args``) for OpenTelemetry traces of its inferences, sent
    over OTLP/HTTP to ``endpoint`` (``http://host:4318/v1/traces``; this build's exporter
    speaks HTTP with JSON bodies, not gRPC). Measured on the wheel's server: a request
    whose gRPC metadata carries a W3C ``traceparent`` is traced as that trace's child
    (``InferRequest`` → the model's span → ``compute``), so a gateway's search and its
    encode are one trace. It does not honour the ``traceparent``'s sampled flag (a
    request marked 00 was traced all the same): it samples 1 request in ``rate`` by its
    own count, here round(1 / ``ratio``); ``ratio`` 0 gives no flags (not traced).
    docs/tracing.md."""
    if ratio <= 0:
        return ()
    return (
        "--trace-config=mode=opentelemetry",
        f"--trace-config=opentelemetry,url={endpoint}",
        f"--trace-config=opentelemetry,resource=service.name={service}",
        f"--trace-config=rate={max(1, round(1.0 / ratio))}",
        "--trace-config=count=-1",
        "--trace-config=level=TIMESTAMPS",
    )


@dataclass
class TritonHandle:
    config: TritonServerConfig
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def grpc_url(self) -> str:
        return self.config.grpc_url

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def model_ready(
    grpc_url: str, model: str, tls: ClientTLS | None = None, timeout: float = 1.0
) -> bool:
    """True when Triton at ``grpc_url`` says ``model`` is ready (KServe v2 ``ModelReady``
    over gRPC, through ``tls`` when its gRPC port has TLS): the one readiness check of
    ours, so that nothing needs Triton's unauthenticated HTTP endpoint."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from services.rpc.tls import channel

    try:
        with channel(grpc_url, tls) as ch:
            reply = service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelReady(
                service_pb2.ModelReadyRequest(name=model), timeout=timeout
            )
            return bool(reply.ready)
    except grpc.RpcError:
        return False


def wait_ready(handle: TritonHandle, tls: ClientTLS | None = None) -> None:
    """Poll the model's readiness over gRPC (through ``tls`` when the server has TLS);
    fail fast with the log tail if the server died."""
    deadline = time.monotonic() + handle.config.startup_timeout_s
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            raise Unavailable(
                f"tritonserver exited with {handle.process.returncode}:\n{handle.log_tail()}"
            )
        if model_ready(handle.config.grpc_url, handle.config.ready_model, tls):
            return
        time.sleep(0.2)
    raise Unavailable(
        f"model {handle.config.ready_model!r} not ready after "
        f"{handle.config.startup_timeout_s:.0f} s:\n{handle.log_tail()}"
    )


def stop(handle: TritonHandle) -> None:
    """SIGTERM (Triton drains in-flight requests), then SIGKILL after the timeout."""
    if handle.process.poll() is not None:
        return
    handle.process.send_signal(signal.SIGTERM)
    try:
        handle.process.wait(handle.config.stop_timeout_s)
    except subprocess.TimeoutExpired:
        handle.process.kill()
        handle.process.wait(10)


@contextmanager
def run_triton(
    cfg: TritonServerConfig, log_path: Path, tls: ClientTLS | None = None
) -> Iterator[TritonHandle]:
    """Start tritonserver, yield once ``cfg.ready_model`` is ready (asked over gRPC,
    through ``tls`` when the server has TLS), stop it on exit."""
    argv, env = triton_command(cfg)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    handle = TritonHandle(cfg, process, log_path)
    try:
        wait_ready(handle, tls)
        yield handle
    finally:
        stop(handle)
