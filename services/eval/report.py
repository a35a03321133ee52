"""Scores of every system, side by side: a table for people and one JSON line, last."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from services.eval.config import EvalConfig
from services.eval.data import EvalData
from services.eval.inprocess import Systems
from services.measures.entropy import contrastive_entropy
from services.measures.ranking import MEASURE_NAMES, paired_comparison, score

NO_CHECKPOINT = (
    "not measured: no --rerank-checkpoint given (an untrained CELI head ranks at random; "
    "train one with `gtr-retrieval rerank train`)"
)


def entropy_of(data: EvalData, cfg: EvalConfig) -> dict[str, Any]:
    """Contrastive entropy of the encoder over every relevant pair of the evaluated queries."""
    row_of = {d: i for i, d in enumerate(data.beir.doc_ids)}
    relevant = {qi: {row_of[d] for d in data.beir.qrels[q]} for qi, q in enumerate(data.qids)}
    pairs = [(qi, di) for qi in sorted(relevant) for di in sorted(relevant[qi])]
    negatives = min(cfg.negatives, len(row_of) - max(len(r) for r in relevant.values()))
    value = contrastive_entropy(
        data.query_vectors, data.doc_vectors, pairs, relevant, negatives, cfg.temperature
    )
    return {
        "value": round(value, 4),
        "pairs": len(pairs),
        "negatives": negatives,
        "temperature": cfg.temperature,
    }


def build(
    data: EvalData, cfg: EvalConfig, systems: Systems, entropy: dict[str, Any] | None
) -> dict[str, Any]:
    qrels = data.beir.qrels
    first = "service_default" if "service_default" in systems.runs else "ivfpq_default"
    main = {name: run for name, run in systems.runs.items() if not name.endswith("+rerank")}
    scores = {name: score(run, qrels, data.qids) for name, run in main.items()}
    report: dict[str, Any] = {
        "data": str(cfg.data_dir),
        "split": cfg.split,
        "queries": len(data.qids),
        "model": data.model,
        "path": "gateway" if cfg.gateway else "in-process",
    }
    for key in MEASURE_NAMES:
        report[key] = {name: round(s.mean(key), 4) for name, s in scores.items()}
    if "exact" in scores:
        report["ivfpq_default_vs_exact"] = paired_comparison(
            scores["exact"].values("ndcg_at_10"), scores[first].values("ndcg_at_10")
        )
    reranked = f"{first}+rerank"
    if reranked in systems.runs:
        held = list(systems.rerank["queries"])
        base = score(systems.runs[first], qrels, held)
        after = score(systems.runs[reranked], qrels, held)
        report["rerank"] = {
            **{k: v for k, v in systems.rerank.items() if k != "queries"},
            "queries": len(held),
            "on": "the checkpoint's held-out (dev) queries, never trained on",
            **{
                key: {first: round(base.mean(key), 4), reranked: round(after.mean(key), 4)}
                for key in MEASURE_NAMES
            },
            "gain_ndcg_at_10": paired_comparison(
                base.values("ndcg_at_10"), after.values("ndcg_at_10")
            ),
        }
    else:
        report["rerank"] = {"skipped": NO_CHECKPOINT}
    if "bm25" in systems.runs and systems.dev:
        dense = "service_dense" if "service_dense" in systems.runs else "ivfpq_default"
        report["hybrid"] = hybrid_section(systems, qrels, dense)
    report["index"] = systems.index
    if entropy is not None:
        report["contrastive_entropy"] = entropy["value"]
        report["contrastive_entropy_setup"] = {k: v for k, v in entropy.items() if k != "value"}
    report["seconds"] = {k: round(v, 1) for k, v in systems.seconds.items()}
    return report


HYBRID_SYSTEMS = ("bm25", "hybrid_rrf", "hybrid_weighted")


def hybrid_section(
    systems: Systems, qrels: dict[str, dict[str, int]], dense: str
) -> dict[str, Any]:
    """BM25, dense and each fusion on the dev queries, paired against ``dense`` (nDCG@10
    and Recall@100), and CELI over dense and over the default fusion when a checkpoint
    was given (only held-out queries are reranked, so those are the dev queries then)."""
    dev = list(systems.dev)
    names = [dense, *HYBRID_SYSTEMS]
    names += [n for n in (f"{dense}+rerank", "hybrid_weighted+rerank") if n in systems.runs]
    scores = {n: score(systems.runs[n], qrels, dev) for n in names}
    base = scores[dense]
    out: dict[str, Any] = {
        "on": "dev queries: never seen by a reranker trained on this data's train split",
        "queries": len(dev),
        **{key: {n: round(s.mean(key), 4) for n, s in scores.items()} for key in MEASURE_NAMES},
        "vs_dense": {
            n: {
                key: paired_comparison(base.values(key), scores[n].values(key))
                for key in ("ndcg_at_10", "recall_at_100")
            }
            for n in HYBRID_SYSTEMS
        },
    }
    if "hybrid_weighted+rerank" in scores and f"{dense}+rerank" in scores:
        out["rerank_hybrid_vs_dense"] = paired_comparison(
            scores[f"{dense}+rerank"].values("ndcg_at_10"),
            scores["hybrid_weighted+rerank"].values("ndcg_at_10"),
        )
    return out


def table(report: dict[str, Any]) -> str:
    """The report as text; every figure says which queries it is on."""
    lines = [
        f"{report['data']} (split {report['split']}), {report['queries']} queries, "
        f"{report['model']}, {report['path']}",
        "",
    ]
    nprobe = report.get("index", {}).get("nprobe_default")
    header = f"{'system':<28} {'nDCG@10':>8} {'Recall@100':>10} {'MRR@10':>8} {'ΔnDCG@10':>9}"
    lines += [header, "-" * len(header)]
    exact = report["ndcg_at_10"].get("exact")
    for name, ndcg in report["ndcg_at_10"].items():
        label = f"{name} (nprobe {nprobe})" if name == "ivfpq_default" and nprobe else name
        delta = "" if exact is None or name == "exact" else f"{ndcg - exact:+.4f}"
        lines.append(
            f"{label:<28} {ndcg:>8.4f} {report['recall_at_100'][name]:>10.4f} "
            f"{report['mrr_at_10'][name]:>8.4f} {delta:>9}"
        )
    if "ivfpq_default_vs_exact" in report:
        c = report["ivfpq_default_vs_exact"]
        lines.append(
            f"default vs exact, nDCG@10 per query: {c['wins']} better, {c['losses']} "
            f"worse, {c['ties']} same; mean {c['mean_diff']:+.4f} "
            f"(95 % CI {c['ci95'][0]:+.4f}..{c['ci95'][1]:+.4f})"
        )
    rerank = report["rerank"]
    lines.append("")
    if "skipped" in rerank:
        lines.append(f"rerank: {rerank['skipped']}")
    else:
        g = rerank["gain_ndcg_at_10"]
        first, after = rerank["ndcg_at_10"].items()
        lines.append(
            f"rerank ({rerank['checkpoint']}, depth {rerank['depth']}) on "
            f"{rerank['queries']} held-out queries: nDCG@10 {first[1]:.4f} -> "
            f"{after[1]:.4f} ({g['mean_diff']:+.4f}, 95 % CI {g['ci95'][0]:+.4f}.."
            f"{g['ci95'][1]:+.4f}, paired t-test p {g['p_value']:.3g})"
        )
    if "hybrid" in report:
        h = report["hybrid"]
        lines += ["", f"hybrid on {h['queries']} dev queries ({h['on']}):"]
        for name, ndcg in h["ndcg_at_10"].items():
            line = f"  {name:<26} nDCG@10 {ndcg:.4f}  Recall@100 {h['recall_at_100'][name]:.4f}"
            if name in h["vs_dense"]:
                c = h["vs_dense"][name]["ndcg_at_10"]
                line += (
                    f"  vs dense {c['mean_diff']:+.4f} (95 % CI {c['ci95'][0]:+.4f}.."
                    f"{c['ci95'][1]:+.4f})"
                )
            lines.append(line)
        if "rerank_hybrid_vs_dense" in h:
            c = h["rerank_hybrid_vs_dense"]
            lines.append(
                f"  CELI over hybrid_weighted vs over dense: {c['mean_diff']:+.4f} "
                f"(95 % CI {c['ci95'][0]:+.4f}..{c['ci95'][1]:+.4f})"
            )
    if "contrastive_entropy" in report:
        s = report["contrastive_entropy_setup"]
        lines.append(
            f"contrastive entropy (Fang et al. 2024; {s['pairs']} relevant pairs, "
            f"{s['negatives']} random negatives, temperature {s['temperature']}): "
            f"{report['contrastive_entropy']:.4f} (log({s['negatives'] + 1}) = "
            f"{np.log(s['negatives'] + 1):.2f} is chance)"
        )
    if report.get("index", {}).get("factory"):
        i = report["index"]
        lines.append(
            f"index: {i['factory']}, default nprobe {i['nprobe_default']} of "
            f"{i['nlist']} (tuned: 10-recall@10 {i['measured_recall_at_10']}, "
            f"{i['wide_k']}-recall@{i['wide_k']} {i['measured_wide_recall']} "
            "on held-out vectors)"
        )
    return "\n".join(lines)


def json_line(report: dict[str, Any]) -> str:
    return json.dumps(report, separators=(", ", ": "))
