"""Generated Triton repositories, parsed with Triton's own ModelConfig protobuf."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from services.common.errors import FailedPrecondition, InvalidArgument
from services.encoder.base import DOCUMENT_PRIORITY, PRIORITY_LEVELS, QUERY_PRIORITY
from services.encoder.build.plan_meta import PlanMeta, PlanVersionMismatch
from services.encoder.build.repository import RepositoryConfig, generate_repository, read_config
from services.encoder.build.tensorrt_build import TENSORRT_VERSION
from services.encoder.model import default_model_dir
from tests.encoder_fixtures import encoder_base, ensure_onnx, ensure_tiny_t5


@pytest.fixture(scope="module")
def minilm_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_onnx(default_model_dir(), encoder_base(tmp_path_factory))


def _io(config: mc.ModelConfig) -> dict[str, tuple[int, list[int]]]:
    return {t.name: (t.data_type, list(t.dims)) for t in [*config.input, *config.output]}


def test_cpu_repository(minilm_onnx: Path, tmp_path: Path) -> None:
    repo = generate_repository(minilm_onnx, tmp_path, RepositoryConfig(intra_op_threads=2))
    assert repo.models == ("embed",)
    config = read_config(repo.config_path("embed"))
    assert config.name == "embed" and config.backend == "python"
    assert config.max_batch_size == 64
    assert _io(config) == {
        "TEXT": (mc.TYPE_STRING, [1]),
        "KIND": (mc.TYPE_STRING, [1]),
        "EMBEDDING": (mc.TYPE_FP32, [384]),
        "TRUNCATED": (mc.TYPE_BOOL, [1]),
        "ENCODER": (mc.TYPE_STRING, [1]),  # the version's description, asked at connect
    }
    batching = config.dynamic_batching
    assert list(batching.preferred_batch_size) == [16, 32, 64]  # CPU: no small batches
    assert batching.max_queue_delay_microseconds == 1000
    # No queue policy: with one, Triton 24.10 held a request that arrived during a batch
    # until the next one arrived (bench/triton_batcher.py).
    assert not batching.HasField("default_queue_policy")
    # No priority levels by default: with them, as with a queue policy, Triton 24.10 held
    # a request that arrived during a batch until the next one arrived (~0.5 s).
    assert (batching.priority_levels, batching.default_priority_level) == (0, 0)
    (group,) = config.instance_group
    assert group.kind == mc.ModelInstanceGroup.KIND_CPU and group.count == 1
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["source_model"] == "all-MiniLM-L6-v2" and params["dim"] == "384"
    assert params["intra_op_threads"] == "2"
    assert params["allow_spinning"] == "0"  # busy-waiting threads stall the stub
    version = tmp_path / "embed" / "1"
    for name in (
        "model.py",
        "textcodec.py",
        "model.onnx",
        "tokenizer.json",
        "encoder.json",
        "version.json",
    ):
        assert (version / name).is_file(), name
    # what is version 1's goes in its folder, not in config.pbtxt (a publish leaves it)
    own = json.loads((version / "version.json").read_text())
    assert own["source_model"] == "all-MiniLM-L6-v2" and len(own["digest"]) == 16
    assert not [k for k in params if k.startswith("version.")]
    # the publish lock exists before Triton loads the model (one made later would count
    # as a change of every version and reload them)
    assert (tmp_path / "embed" / ".publish.lock").is_file()
    # model.py is the file from services/encoder/build/triton_models, not a generated string
    source = Path("services/encoder/build/triton_models/embed_onnx.py").read_text()
    assert (version / "model.py").read_text() == source


def _fake_plan(
    path: Path, max_shape: tuple[int, int] = (64, 512), tensorrt: str = TENSORRT_VERSION + ".23"
) -> Path:
    path.write_bytes(b"not a real engine")
    PlanMeta(tensorrt, "fp16", (1, 1), (8, 128), max_shape, 0.9995, 100).write(path)
    return path


def test_gpu_repository_is_an_ensemble(minilm_onnx: Path, tmp_path: Path) -> None:
    plan = _fake_plan(tmp_path / "fake.plan")
    repo = generate_repository(
        minilm_onnx, tmp_path / "repo", RepositoryConfig(flavor="gpu", plan_path=plan)
    )
    assert set(repo.models) == {"tokenizer", "encoder", "embed"}
    tok, enc, embed = (read_config(repo.config_path(m)) for m in ("tokenizer", "encoder", "embed"))
    assert tok.backend == "python" and enc.platform == "tensorrt_plan"
    assert embed.platform == "ensemble"
    assert {k: v for k, v in _io(tok).items() if k in ("TEXT", "KIND")} == {
        "TEXT": (mc.TYPE_STRING, [1]),
        "KIND": (mc.TYPE_STRING, [1]),
    }
    assert _io(embed)["EMBEDDING"] == (mc.TYPE_FP32, [384])
    assert _io(enc) == {
        "input_ids": (mc.TYPE_INT64, [-1]),
        "attention_mask": (mc.TYPE_INT64, [-1]),
        "embedding": (mc.TYPE_FP32, [384]),
    }
    (group,) = enc.instance_group
    assert group.kind == mc.ModelInstanceGroup.KIND_GPU and group.count == 1  # minilm profile
    assert list(enc.dynamic_batching.preferred_batch_size) == [4, 8, 16, 32, 64]
    # one queue by default, as on CPU (priority levels stall late arrivals)
    assert enc.dynamic_batching.priority_levels == 0
    steps = list(embed.ensemble_scheduling.step)
    assert [s.model_name for s in steps] == ["tokenizer", "encoder"]
    assert dict(steps[0].output_map) == {
        "INPUT_IDS": "ids",
        "ATTENTION_MASK": "mask",
        "TRUNCATED": "TRUNCATED",
    }
    assert dict(steps[1].input_map) == {"input_ids": "ids", "attention_mask": "mask"}
    assert dict(steps[1].output_map) == {"embedding": "EMBEDDING"}
    # every ensemble tensor is produced before it is consumed
    produced = {"TEXT", "KIND"}
    for step in steps:
        assert set(step.input_map.values()) <= produced
        produced |= set(step.output_map.values())
    assert {"EMBEDDING", "TRUNCATED"} <= produced
    buckets = tok.parameters["seq_buckets"].string_value
    assert buckets == "16,32,64,128,256,512"
    assert (tmp_path / "repo" / "encoder" / "1" / "model.plan").read_bytes() == b"not a real engine"
    assert (tmp_path / "repo" / "tokenizer" / "1" / "model.py").exists()


def test_gpu_repository_takes_its_shapes_from_the_plan(minilm_onnx: Path, tmp_path: Path) -> None:
    import json

    plan = _fake_plan(tmp_path / "small.plan", max_shape=(16, 200))
    repo = generate_repository(
        minilm_onnx, tmp_path / "repo", RepositoryConfig(flavor="gpu", plan_path=plan)
    )
    configs = {m: read_config(repo.config_path(m)) for m in ("tokenizer", "encoder", "embed")}
    assert {c.max_batch_size for c in configs.values()} == {16}  # the profile says 64
    assert list(configs["encoder"].dynamic_batching.preferred_batch_size) == [4, 8, 16]
    buckets = configs["tokenizer"].parameters["seq_buckets"].string_value
    assert buckets == "16,32,64,128,200"  # nothing the plan does not cover
    tok_meta = json.loads((tmp_path / "repo" / "tokenizer" / "1" / "encoder.json").read_text())
    assert tok_meta["max_lens"] == {"query": 64, "document": 200}  # truncation fits the plan
    recorded = tmp_path / "repo" / "encoder" / "1" / "model.plan.json"
    assert json.loads(recorded.read_text())["max_shape"] == [16, 200]
    # issue #37 item 7: the TensorRT model warms up every bucket before it is READY, in
    # shapes the plan covers, naming the model's own inputs
    warmup = configs["encoder"].model_warmup
    shapes = [(w.batch_size, *{tuple(i.dims) for i in w.inputs.values()}) for w in warmup]
    assert shapes == [(1, (b,)) for b in (16, 32, 64, 128, 200)] + [(16, (200,))]
    inputs = {i.name for i in configs["encoder"].input}
    assert all(set(w.inputs) == inputs and w.count == 1 for w in warmup)
    data = [i for w in warmup for i in w.inputs.values()]
    assert all(i.zero_data and i.data_type == mc.TYPE_INT64 for i in data)


def test_the_tokenizer_carries_the_plans_precision(minilm_onnx: Path, tmp_path: Path) -> None:
    """Issue #25 item 10: the tokenizer exports gtr_encoder_plan_info from these."""
    plan = _fake_plan(tmp_path / "fake.plan")
    repo = generate_repository(
        minilm_onnx, tmp_path / "repo", RepositoryConfig(flavor="gpu", plan_path=plan)
    )
    params = {
        k: v.string_value for k, v in read_config(repo.config_path("tokenizer")).parameters.items()
    }
    assert params["plan_precision"] == "fp16"
    assert params["plan_tensorrt_version"] == TENSORRT_VERSION + ".23"
    assert params["plan_gpu"] == "unknown"


def test_gpu_repository_refuses_a_batch_the_plan_does_not_cover(
    minilm_onnx: Path, tmp_path: Path
) -> None:
    plan = _fake_plan(tmp_path / "small.plan", max_shape=(16, 512))
    with pytest.raises(InvalidArgument, match="exceeds the plan's maximum batch 16"):
        cfg = RepositoryConfig(flavor="gpu", plan_path=plan, max_batch=32)
        generate_repository(minilm_onnx, tmp_path / "repo", cfg)


def test_gpu_repository_refuses_a_plan_of_another_tensorrt(
    minilm_onnx: Path, tmp_path: Path
) -> None:
    plan = _fake_plan(tmp_path / "trt11.plan", tensorrt="11.4.0.106")
    with pytest.raises(PlanVersionMismatch, match=r"TensorRT 11\.4\.0\.106"):
        generate_repository(
            minilm_onnx, tmp_path / "repo", RepositoryConfig(flavor="gpu", plan_path=plan)
        )
    with pytest.raises(FailedPrecondition, match="not known here"):
        generate_repository(
            minilm_onnx,
            tmp_path / "repo",
            RepositoryConfig(
                flavor="gpu",
                plan_path=_fake_plan(tmp_path / "ok.plan"),
                triton_image_tag="19.01-py3",
            ),
        )


def test_gpu_repository_refuses_a_plan_without_its_metadata(
    minilm_onnx: Path, tmp_path: Path
) -> None:
    plan = tmp_path / "bare.plan"
    plan.write_bytes(b"not a real engine")
    with pytest.raises(FailedPrecondition, match="build-plan"):
        generate_repository(
            minilm_onnx, tmp_path / "repo", RepositoryConfig(flavor="gpu", plan_path=plan)
        )


def test_gtr_profile_sets_instances_on_gpu(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    base = encoder_base(tmp_path_factory)
    onnx_path = ensure_onnx(ensure_tiny_t5(base), base)
    repo = generate_repository(onnx_path, tmp_path, RepositoryConfig(flavor="gpu"))
    enc = read_config(repo.config_path("encoder"))
    assert enc.instance_group[0].count == 2  # GTR-base profile: two instances per GPU
    assert list(enc.dynamic_batching.preferred_batch_size) == [4, 8, 16, 32, 64]
    assert enc.dynamic_batching.max_queue_delay_microseconds == 1000
    assert not enc.dynamic_batching.HasField("default_queue_policy")
    assert (tmp_path / "encoder" / "1" / "README").exists()  # no plan given: instructions


def test_regenerating_replaces_our_models_only(minilm_onnx: Path, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    generate_repository(minilm_onnx, tmp_path, RepositoryConfig(flavor="gpu"))
    generate_repository(minilm_onnx, tmp_path, RepositoryConfig(flavor="cpu"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embed", "other"]


def test_missing_export_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="encoder export"):
        generate_repository(tmp_path / "none.onnx", tmp_path / "repo")


def test_a_queue_bound_is_opt_in(minilm_onnx: Path, tmp_path: Path) -> None:
    cfg = RepositoryConfig(max_queue_size=32, preferred_batch_sizes=(8, 128), max_batch=64)
    config = read_config(generate_repository(minilm_onnx, tmp_path, cfg).config_path("embed"))
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 32
    assert list(config.dynamic_batching.preferred_batch_size) == [8]  # within max_batch


def test_request_priority_is_opt_in(minilm_onnx: Path, tmp_path: Path) -> None:
    cfg = RepositoryConfig(priority_levels=PRIORITY_LEVELS)
    config = read_config(generate_repository(minilm_onnx, tmp_path, cfg).config_path("embed"))
    batching = config.dynamic_batching
    # queries (and callers naming no priority) before the builder's document batches
    assert (batching.priority_levels, batching.default_priority_level) == (2, QUERY_PRIORITY)
    assert QUERY_PRIORITY < DOCUMENT_PRIORITY <= batching.priority_levels  # 1 = first
