"""docs/deploy.md "First GPU run", run on a CPU as far as each command goes without a GPU.

The checklist's commands are read from the document itself (row numbers are the keys),
with ``$GTR`` a tiny T5 checkpoint in GTR's layout, ``$CORPUS`` a small JSONL corpus and
``build/`` a temporary folder, and run here until the step that needs a GPU: that step
must then fail for that reason and no other (TensorRT missing, no CUDA device), so that a
wrong flag, path, image or file name shows up now and not on the day a GPU appears.
Issue #25 item 11.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from services.encoder.build.plan_meta import PlanMeta, write_plan
from services.encoder.build.tensorrt_build import NO_TRT_REASON, TENSORRT_VERSION
from tests.encoder_fixtures import encoder_base, ensure_tiny_t5

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deploy.md"
CLI = str(Path(sys.executable).parent / "gtr-retrieval")
VALUES = yaml.safe_load((ROOT / "deploy/k8s/gtr-retrieval/values.yaml").read_text())


def checklist() -> dict[int, tuple[str, list[str], str]]:
    """Row number → (check, the command column's code spans, passes-when)."""
    text = DOC.read_text()
    section = text[text.index("## First GPU run") : text.index("## What was verified")]
    rows: dict[int, tuple[str, list[str], str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and cells[0].isdigit():
            spans = [s.replace("\\|", "|") for s in re.findall(r"`([^`]+)`", cells[2])]
            rows[int(cells[0])] = (cells[1], spans, cells[3])
    return rows


ROWS = checklist()


def image(key: str) -> str:
    i = VALUES["images"]
    return f"{i['registry']}/{i[key]}:{i['tag']}"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """$GTR, $CORPUS and build/ of the checklist, on this machine."""
    base = encoder_base(tmp_path_factory)
    work = tmp_path_factory.mktemp("first-gpu-run")
    corpus = work / "corpus.jsonl"
    rng = np.random.default_rng(0)
    words = [
        "dense",
        "retrieval",
        "encoder",
        "index",
        "shard",
        "query",
        "document",
        "latency",
        "vector",
    ]
    with corpus.open("w") as fh:
        for i in range(400):
            text = " ".join(rng.choice(words, size=12).tolist())
            fh.write(json.dumps({"id": f"d{i}", "title": f"doc {i}", "text": text}) + "\n")
    return {"GTR": ensure_tiny_t5(base), "CORPUS": corpus, "build": work / "build"}


def argv(span: str, env: dict[str, Path]) -> list[str]:
    """A documented command as this machine runs it (its own CLI and python)."""
    text = span.replace("$GTR", str(env["GTR"])).replace("$CORPUS", str(env["CORPUS"]))
    args = [
        a.replace("build/", f"{env['build']}/", 1) if a.startswith("build/") else a
        for a in shlex.split(text)
    ]
    args = [re.sub(r"(=)build/", rf"\g<1>{env['build']}/", a) for a in args]
    if args[0] == "gtr-retrieval":
        args[0] = CLI
    elif args[0] == "python":
        args[0] = sys.executable
    return args


def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def span(row: int, start: str) -> str:
    found = [s for s in ROWS[row][1] if s.startswith(start)]
    assert found, f"row {row} has no command starting with {start!r}: {ROWS[row][1]}"
    return found[0]


def test_the_checklist_has_its_rows() -> None:
    assert sorted(ROWS) == list(range(1, 18))
    checks = " ".join(check for check, _, _ in ROWS.values())
    for topic in (
        "our images",
        "uid 10001",
        "second start",
        "xl/xxl",
        "2 instances",
        "GPU shards",
        "GPU rerank",
        "128 tokens",
    ):
        assert topic in checks, topic


@pytest.mark.slow
def test_row_1_reaches_the_gpu_imports() -> None:
    done = run(argv(ROWS[1][1][0], {"GTR": Path(), "CORPUS": Path(), "build": Path()}))
    assert done.returncode != 0 and "No module named 'tensorrt'" in done.stderr
    code = ROWS[1][1][0].split('"')[1].replace("import tensorrt, ", "import ")
    code = code.replace("tensorrt.__version__, ", "")
    done = run([sys.executable, "-c", code])
    assert done.returncode == 0 and done.stdout.split() == ["None", "False", "0"]  # CPU torch


@pytest.mark.slow
def test_row_2_extras_exist_and_the_gpu_tests_skip_naming_why() -> None:
    install = span(2, "pip install")
    extras = re.search(r"\.\[([\w,]+)\]", install)
    assert extras is not None
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(extras.group(1).split(",")) == {"gpu", "dev"} <= set(optional)
    assert any(r.startswith("faiss-gpu==") for r in optional["gpu"])
    assert any(r.startswith("pytest==") for r in optional["dev"])
    tests = argv(span(2, "python -m pytest"), {"GTR": Path(), "CORPUS": Path(), "build": Path()})
    done = run([*tests, "-p", "no:cacheprovider"])
    expected = int(re.search(r"(\d+) passed", ROWS[2][2]).group(1))  # type: ignore[union-attr]
    assert f"{expected} skipped" in done.stdout, done.stdout[-2000:]
    reasons = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(reasons) == expected
    assert all("GPU" in r or "TensorRT" in r for r in reasons), reasons


def test_row_3_names_our_images() -> None:
    done = run(["bash", "scripts/build_images.sh", "--gpu", "--print"])
    assert done.returncode == 0, done.stderr
    built = set(re.findall(r"=(\S+)", done.stdout))
    for name in re.findall(r"`(ghcr\.io/[^`\s]+)`", ROWS[3][2]):
        assert name in built, (name, built)
    assert image("triton") in ROWS[3][2] and image("appGpu") in ROWS[3][2]


@pytest.mark.slow
def test_rows_4_to_9_run_up_to_tensorrt(env: dict[str, Path]) -> None:
    # 4: the export runs whole on a CPU
    done = run(argv(ROWS[4][1][0], env))
    assert done.returncode == 0 and "parity OK" in done.stdout, done.stdout + done.stderr
    onnx = env["build"] / "gtr" / "model.onnx"
    assert onnx.exists()
    # 5: build-plan stops where TensorRT is needed
    done = run(argv(ROWS[5][1][0], env))
    assert done.returncode == 2 and NO_TRT_REASON in done.stderr, done.stderr
    # 6: the repository around a plan (a stand-in with the metadata build-plan writes)
    plan = env["build"] / "gtr" / "model.plan"
    write_plan(
        plan,
        b"stand-in",
        PlanMeta(
            TENSORRT_VERSION, "fp16", (1, 1), (8, 128), (64, 512), 0.9995, 40, "NVIDIA L4", "8.9"
        ),
    )
    done = run(argv(span(6, "gtr-retrieval encoder repo"), env))
    assert done.returncode == 0, done.stderr
    assert {p.name for p in (env["build"] / "repo").iterdir()} >= {"tokenizer", "encoder", "embed"}
    docker = shlex.split(span(6, "docker run"))
    assert image("triton") in docker  # ours, not NVIDIA's stock image
    assert docker[docker.index(image("triton")) + 1 :] == ["--model-repository=/models"]
    assert 'ENTRYPOINT ["tritonserver"]' in (ROOT / "deploy/docker/triton.Dockerfile").read_text()
    # 7 and 8: the init container's command, as the chart runs it, up to TensorRT
    docker = shlex.split(span(7, "docker run"))
    assert docker[docker.index("--user") + 1] == "10001:10001"
    assert VALUES["podSecurityContext"]["runAsUser"] == 10001 and "--read-only" in docker
    assert VALUES["containerSecurityContext"]["readOnlyRootFilesystem"] is True
    at = docker.index(image("appGpu"))
    assert (
        'ENTRYPOINT ["gtr-retrieval"]'
        in (ROOT / "deploy/docker/gtr-retrieval-gpu.Dockerfile").read_text()
    )
    command = docker[at + 1 :]
    chart_args = (ROOT / "deploy/k8s/gtr-retrieval/templates/triton.yaml").read_text()
    for arg in command[:2] + [a.split("=")[0] for a in command[2:]]:
        assert f"- {arg}" in chart_args, arg  # the flags the chart's init container passes
    mounts = {
        docker[i + 1].split(":")[1]: docker[i + 1].split(":")[0]
        for i, a in enumerate(docker)
        if a == "-v"
    }
    local = [
        a.replace("/model-src/checkpoint", str(env["GTR"]))
        .replace("/model-src/export", str(env["build"] / "gtr"))
        .replace("/plans", str(env["build"] / "plans"))
        .replace("/models", str(env["build"] / "repo-ep"))
        for a in command
    ]
    assert set(mounts) >= {"/model-src/checkpoint", "/model-src/export", "/plans", "/models"}
    done = run([CLI, *local])
    assert done.returncode == 2 and NO_TRT_REASON in done.stderr, done.stderr
    assert "same `docker run`" in ROWS[8][1][0] or "docker run" in " ".join(ROWS[8][1])
    # 9: the host run that is timed, up to TensorRT
    prefix = "/usr/bin/time -v "
    assert ROWS[9][1][0].startswith(prefix)
    done = run(argv(ROWS[9][1][0].removeprefix(prefix), env))
    assert done.returncode == 2 and NO_TRT_REASON in done.stderr, done.stderr


def test_row_10_names_a_test_that_exists() -> None:
    path = re.search(r"(tests/\S+\.py)", ROWS[10][1][0])
    assert path is not None and (ROOT / path.group(1)).exists()


def test_rows_11_and_12_perf_input_of_128_tokens_and_two_instances(
    env: dict[str, Path],
) -> None:
    from services.encoder.build.export import EncoderMeta, export_onnx
    from services.encoder.textcodec import TextCodec

    onnx = env["build"] / "gtr" / "model.onnx"
    if not onnx.exists():
        export_onnx(env["GTR"], onnx)
    done = run(argv(span(11, "gtr-retrieval encoder perf-input"), env))
    assert done.returncode == 0, done.stderr
    data_file = env["build"] / "perf128.json"
    rows = json.loads(data_file.read_text())["data"]
    meta = EncoderMeta.read(onnx.parent)
    codec = TextCodec.from_file(str(onnx.parent / "tokenizer.json"), meta.max_lens, meta.pad_id)
    for row in rows:
        batch = codec.encode(row["TEXT"], row["KIND"][0])
        assert int(batch.attention_mask.sum()) == 128 and not batch.truncated.any()
    perf = shlex.split(span(11, "perf_analyzer"))
    assert perf[perf.index("--input-data") + 1] == "build/perf128.json"
    # a query of 128 tokens cannot be measured: the export cuts queries shorter
    query = argv(span(11, "gtr-retrieval encoder perf-input"), env)
    query[query.index("--kind") + 1] = "query"
    if meta.max_lens["query"] < 128:
        refused = run(query)
        assert refused.returncode == 2 and "--kind document" in refused.stderr
    # 12: two instances of the TensorRT model in the repository
    plan = env["build"] / "gtr" / "model.plan"
    if not plan.exists():
        write_plan(
            plan,
            b"stand-in",
            PlanMeta(
                TENSORRT_VERSION,
                "fp16",
                (1, 1),
                (8, 128),
                (64, 512),
                0.9995,
                40,
                "NVIDIA L4",
                "8.9",
            ),
        )
    done = run(argv(span(12, "gtr-retrieval encoder repo"), env))
    assert done.returncode == 0, done.stderr
    config = (env["build"] / "repo2" / "encoder" / "config.pbtxt").read_text()
    assert re.search(r"instance_group \{\s*count: 2", config), config
    perf = shlex.split(span(12, "perf_analyzer"))
    assert perf[perf.index("--input-data") + 1] == "build/perf128.json"


@pytest.mark.slow
def test_rows_13_and_14_embed_and_train_for_the_gpu(env: dict[str, Path]) -> None:
    embed, train = (
        argv(span(13, start), env)
        for start in ("gtr-retrieval encoder embed", "gtr-retrieval index train")
    )
    # issue #37 item 7: the row embeds on the GPU; here the CUDA device is refused clearly
    assert embed[embed.index("--device") + 1] == "cuda"
    done = run(embed)
    assert done.returncode == 2 and "sees no CUDA GPU" in done.stderr, done.stderr
    done = run([*embed[: embed.index("--device")], "--device", "cpu"])
    assert done.returncode == 0, done.stderr
    vectors = np.load(env["build"] / "emb768.npy")
    assert vectors.shape[0] == 400 and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-3)
    done = run(train)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((env["build"] / "idx" / "manifest.json").read_text())
    assert manifest["gpu_problem"] is None
    # 14: a 768-d index trained without --gpu is one the GPU refuses (pq_m 192)
    x = np.random.default_rng(0).standard_normal((300, 768)).astype(np.float32)
    np.save(env["build"] / "emb768.npy", x / np.linalg.norm(x, axis=1, keepdims=True))
    plain = [a for a in train if a != "--gpu"] + ["--nlist", "2", "--nprobe", "1"]
    done = run(plain)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((env["build"] / "idx" / "manifest.json").read_text())
    assert manifest["pq_m"] == 192 and "not 192" in manifest["gpu_problem"]
    done = run([a for a in plain] + ["--gpu"])
    assert done.returncode == 0, done.stderr
    manifest = json.loads((env["build"] / "idx" / "manifest.json").read_text())
    assert manifest["pq_m"] == 96 and manifest["gpu_problem"] is None  # as row 13 expects


def test_row_15_writes_beside_the_committed_figures() -> None:
    args = shlex.split(ROWS[15][1][0])
    out = args[args.index("--out") + 1]
    assert out.startswith("build/") and not out.startswith("bench/results")
    done = run([sys.executable, "-m", "bench.index_service", "--help"])
    assert done.returncode == 0 and "--out" in done.stdout


def _sets(command: str) -> dict[str, Any]:
    """The --set values of a documented helm command, as a values tree."""
    args = shlex.split(command)
    values: dict[str, Any] = {}
    for i, a in enumerate(args):
        if a == "--set":
            key, _, raw = args[i + 1].partition("=")
            node = values
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = {"true": True, "false": False}.get(raw, raw)
    return values


@pytest.mark.parametrize("row", [16, 17])
def test_rows_16_and_17_render_gpu_shards_and_gpu_rerank(row: int) -> None:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
    command = ROWS[row][1][0]
    timeout = re.search(r"--timeout (\d+)m", command)
    assert timeout is not None
    with helm.Chart.load(ROOT / "deploy/k8s/gtr-retrieval") as chart:
        rendered = chart.render(_sets(command), name="gtr", namespace="search")
    texts = [text for path, text in rendered.items() if path.endswith(".yaml")]
    docs = [d for text in texts for d in yaml.safe_load_all(text) if d]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    deadline = deployments["gtr-gtr-retrieval-triton"]["spec"]["progressDeadlineSeconds"]
    assert int(timeout.group(1)) * 60 > deadline  # helm waits past a cold Triton rollout
    if row == 16:
        shards = [
            d for d in docs if d["kind"] == "StatefulSet" and "index" in d["metadata"]["name"]
        ]
        for sts in shards:
            (shard,) = sts["spec"]["template"]["spec"]["containers"]
            assert shard["image"] == image("appGpu")
            assert shard["resources"]["limits"]["nvidia.com/gpu"] == 1
    else:
        rerank = deployments["gtr-gtr-retrieval-rerank"]["spec"]["template"]["spec"]
        assert rerank["containers"][0]["image"] == image("appGpu")
        config = next(
            d
            for d in docs
            if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gtr-gtr-retrieval-rerank"
        )
        assert config["data"]["GTR_RERANK_DEVICE"] == "cuda"
