"""``gtr-retrieval plan``: the arithmetic on figures chosen so the answers are derivable."""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path

import pytest

from services.cli.main import main
from services.common.errors import InvalidArgument, NotFound
from services.plan import measured
from services.plan.capacity import GIB, PlanInput, index_bytes_per_vector, plan, rerank_ms
from services.plan.measured import Figure, Measured
from services.plan.scaling import ScalingFit, size_table


def fig(value: float) -> Figure:
    return Figure(value, "test")


# The bench: 100,000 vectors of 384-d, nprobe 10 of nlist 100 (so 10,000 scanned per
# query), 1,000 µs of shard CPU per query (0.1 µs per scanned vector), 488 B per vector.
M = Measured(
    index_vectors=fig(100_000),
    index_dim=fig(384),
    index_nprobe_share=fig(0.1),
    index_nlist=fig(100),
    shard_cpu_us_per_query=fig(1000),
    router_cpu_us_per_query=fig(100),
    bytes_per_vector=fig(488),
    cpu_encoder_texts_per_s=fig(400),
    cpu_encoder_cores=fig(2),
    cpu_encoder_p99_ms=fig(15),
    rerank_ms_at_depth={10: fig(500), 20: fig(1000)},
    rerank_threads=fig(2),
)


def test_bytes_per_vector_and_rerank_interpolation() -> None:
    assert index_bytes_per_vector(M, 384) == 488
    # 768-d: PQ 192 + SQ8 768 + id 8 = 968 against 96 + 384 + 8 = 488
    assert index_bytes_per_vector(M, 768) == pytest.approx(968)
    assert rerank_ms(M, 0) == 0
    assert rerank_ms(M, 5) == 250 and rerank_ms(M, 15) == 750 and rerank_ms(M, 40) == 2000


def test_a_minilm_plan_by_hand() -> None:
    # 1,000,000 docs: nlist = 4·√N = 4,000; nprobe 0.1 × 100 = 10 → 10 × 1e6 / 4,000 =
    # 2,500 vectors scanned → 250 µs per query. Memory 1e6 × 488 × 1.5 = 0.68 GiB.
    inp = PlanInput(docs=1_000_000, qps=1000, model="minilm", slo_ms=100, min_replicas=2)
    p = plan(inp, M)
    assert p["search CPU per query, whole corpus"] == pytest.approx(250)
    assert p["index memory, one copy"] == pytest.approx(1e6 * 488 * 1.5 / GIB)
    assert p["encoder latency"] == 15 and p["rerank latency"] == 0
    assert p["search budget"] == 100 - 15 - 0 - 10
    assert p["shards"] == 1  # 0.25 ms fits 75 ms; 0.68 GiB fits 32 GiB
    # 1,000 q/s × 250 µs = 0.25 cores, / 0.5 utilisation → 1; the minimum 2 wins
    assert p["replicas per shard"] == 2 and p["index cores"] == 2
    # 400 texts/s on 2 cores = 200 per core; 1,000 / (200 × 0.5) = 10 cores
    assert p["encoder cores"] == 10 and p["encoder GPUs"] == 0
    assert p["gateway cores"] == 1  # 1,000 × 100 µs / 0.5 = 0.2 → at least 1
    assert p["CPU cores, total"] == 2 + 10 + 0 + 1


def test_a_gtr_plan_with_rerank_by_hand() -> None:
    # 400,000,000 docs: nlist = 65,536 (the cap); 10 × 4e8 / 65,536 = 61,035 scanned →
    # 6,103.5 µs at 384-d, × 2 for 768-d = 12.2 ms. Memory: 4e8 × 968 × 1.5 = 541 GiB →
    # 17 shards of 32 GiB.
    inp = PlanInput(docs=400_000_000, qps=200, model="large", slo_ms=800, rerank_depth=10)
    p = plan(inp, M)
    scanned = 10 * 4e8 / 65_536
    assert p["search CPU per query, whole corpus"] == pytest.approx(0.1 * scanned * 2)
    assert p["shards"] == math.ceil(4e8 * 968 * 1.5 / GIB / 32) == 17
    shard_us = 0.1 * scanned * 2 / 17
    assert p["replicas per shard"] == max(2, math.ceil(200 * shard_us * 1e-6 / 0.5))
    # GTR-large: 2 instances at 34 ms → 58.8 q/s per GPU, × 0.5 → ⌈200 / 29.4⌉ = 7
    assert p["encoder GPUs"] == 7 and p["encoder cores"] == 0
    # rerank depth 10: 500 ms × 2 threads × 200 q/s / 0.5 = 400 cores
    assert p["rerank cores"] == 400
    assert any("rerank at depth 10 takes 500 ms" in w for w in p.warnings)


def test_latency_shards_and_impossible_slos() -> None:
    # 1e9 docs of 384-d: nlist 65,536, 152,588 scanned → 15.3 ms; a 40 ms SLO with 15 ms
    # of encoder and 10 of overhead leaves 15 ms → 2 shards for latency
    p = plan(PlanInput(docs=10**9, qps=10, model="minilm", slo_ms=40, shard_memory_gib=4096), M)
    assert p["search budget"] == 15 and p["shards"] == 2
    with pytest.raises(InvalidArgument, match="leaves no time for the search"):
        plan(PlanInput(docs=1000, qps=1, model="minilm", slo_ms=20), M)
    with pytest.raises(InvalidArgument):
        plan(PlanInput(docs=0, qps=1), M)
    with pytest.raises(NotFound, match="unknown encoder profile"):
        plan(PlanInput(docs=10, qps=1, model="huge"), M)


def test_the_scaling_law_table(tmp_path: Path) -> None:
    fit = ScalingFit(A=1e8, alpha=0.5, B=1e4, beta=0.5, delta=0.1, source="test")
    # L = ((A/N)^(α/β) + B/D)^β + δ; base N = 1.1e8, D = 1e4: (1e8/1.1e8 + 1)^0.5 + 0.1
    assert fit.entropy(1.1e8, 1e4) == pytest.approx((1e8 / 1.1e8 + 1) ** 0.5 + 0.1)
    rows = {r.size: r for r in size_table(fit, 1e4)}
    xxl, base = rows["xxl"].entropy, rows["base"].entropy
    assert rows["base"].relative_serving_cost == 1.0 and xxl is not None and base is not None
    assert xxl < base
    # the base model at D = 1e4 is the target: base needs exactly 1e4, larger models fewer
    assert rows["base"].annotations_to_match == pytest.approx(1e4)
    large = rows["large"].annotations_to_match
    assert large is not None and large < 1e4
    # MiniLM (2.3e7): (A/N)^(α/β) = 4.35 alone exceeds base's (L − δ)^(1/β) = 1.91: out of
    # reach with any amount of data
    assert rows["minilm"].annotations_to_match is None
    assert all(r.entropy is None for r in size_table(None, None))
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"A": 1, "alpha": 0.5}))
    with pytest.raises(InvalidArgument, match="needs numbers"):
        ScalingFit.read(path)


def test_the_command_reads_the_measured_results_and_prints_its_sources() -> None:
    m = measured.load()  # the repository's bench/results
    assert "index_service.json" in m.bytes_per_vector.source
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", "--docs", "5000000", "--qps", "300", "--model", "base"]) == 0
    lines = out.getvalue().splitlines()
    result = json.loads(lines[-1])
    assert result["plan"]["shards"] >= 1 and result["plan"]["encoder GPUs"] >= 1
    text = "\n".join(lines)
    assert "from bench/results/index_service.json" in text and "profiles.py: base" in text


def test_missing_results_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--docs", "10", "--qps", "1", "--results", str(tmp_path)]) == 2
    assert "run `python -m bench.index_service`" in capsys.readouterr().err


def test_asymmetric_encoders_hold_two_towers_minus_what_they_share() -> None:
    from services.encoder.profiles import get_profile
    from services.plan.towers import tower_params, tower_table

    base = get_profile("base")
    one = base.params_millions * 1e6
    assert tower_params(base, "sde") == one
    assert tower_params(base, "ade") == 2 * one
    assert tower_params(base, "ade-ste") == 2 * one - 32_128 * 768  # one T5 embedding table
    assert tower_params(base, "ade-spl") == 2 * one - 768 * 768  # one projection
    row = next(r for r in tower_table("ade") if r.size == "base")
    assert row.gpu_gib_per_instance == pytest.approx(2 * one * 2 / GIB)  # FP16
    assert row.cpu_gib_per_instance == pytest.approx(2 * one * 4 / GIB)  # FP32
    with pytest.raises(InvalidArgument, match="unknown encoder arch"):
        tower_params(base, "ade-xyz")
    p = plan(PlanInput(docs=100_000, qps=10, model="base", encoder_arch="ade"), M)
    assert p["encoder weights per instance"] == pytest.approx(2 * one * 2 / GIB)


def test_the_text_index_is_sized_from_its_measured_bytes_per_document() -> None:
    import dataclasses

    # measured: 270 B per document of 1,500 B of text; these documents hold 2,000 B
    m = dataclasses.replace(M, text_bytes_per_doc=fig(270), text_doc_bytes=fig(1500))
    inp = PlanInput(docs=1_000_000, qps=1000, model="minilm", slo_ms=100, min_replicas=2)
    p = plan(inp, m)
    assert p["text index bytes per document"] == pytest.approx(360)
    assert p["text index disk per replica"] == pytest.approx(1e6 * 360 / GIB)  # one shard
    vectors, text = 1e6 * 488 / GIB, 1e6 * 360 / GIB
    assert p["shard volume per replica"] == pytest.approx((3 * (vectors + text) + text) * 1.5)
    # without the figure (an older results folder) the plan has no text lines
    assert "text index bytes per document" not in {line.name for line in plan(inp, M).lines}


def test_gpu_shards_take_a_gpu_per_replica_and_twice_that_in_a_rollout() -> None:
    """Issue #37 item 7: the plan says what GPU shards cost (a whole GPU per replica:
    the chart's default 2 shards x 2 replicas is 4, 8 during a rollout)."""
    inp = PlanInput(docs=1_000_000, qps=1000, model="minilm", slo_ms=100, min_replicas=2)
    assert "index GPUs (GPU shards)" not in {line.name for line in plan(inp, M).lines}
    p = plan(replace(inp, gpu_shards=True), M)
    shards, replicas = p["shards"], p["replicas per shard"]
    assert p["index GPUs (GPU shards)"] == shards * replicas
    assert p["index GPUs during a rollout"] == 2 * shards * replicas
