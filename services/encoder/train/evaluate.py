"""Dev-split quality of trained encoders, as they are served: exact search over the corpus.

Each system (the base checkpoint, or a checkpoint of ``encoder train``) is loaded per
tower with :class:`~services.encoder.model.TorchEmbedder` — the serving code path, with
the serving sequence limits — and its query and corpus vectors are cached by the
weights' digest (:mod:`services.encoder.embeddings`), so a second look costs seconds.
Measures: nDCG@10, Recall@100 and MRR@10 by ``ir-measures``; contrastive entropy (Fang
et al. 2024) of the dev pairs; against the base model, the paired bootstrap 95 % interval
of the per-query nDCG@10 difference.

The embedding-space probe (Dong et al. 2022, §5): can a linear classifier tell a query
vector from a document vector? Dev queries and their judged documents, one document per
pair (balanced), 5-fold cross-validated logistic regression accuracy: ≈ 0.5 means one
shared space, ≈ 1.0 two separable clouds. The 2-D view is t-SNE, as in the paper's
figure, one PNG per system.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import InvalidArgument
from services.encoder.embeddings import embed_cached
from services.encoder.train.data import (
    LazyEncoder,
    TrainingData,
    corpus_vectors,
    exact_top,
)
from services.encoder.train.towers import tower_dirs
from services.measures.entropy import NEGATIVES, TEMPERATURE, contrastive_entropy
from services.measures.ranking import Scores, score

log = logging.getLogger(__name__)
DEPTH = 100


@dataclass(frozen=True)
class SystemVectors:
    name: str
    queries: np.ndarray  # dev queries, td.dev_qids order
    docs: np.ndarray  # the corpus, data.doc_ids order


def system_vectors(
    name: str,
    checkpoint: Path,
    td: TrainingData,
    progress: bool,
    doc_len: int | None = None,
) -> SystemVectors:
    """Dev query vectors by the query tower, corpus vectors by the document tower.

    ``doc_len``: documents truncated to this many tokens (None: the serving limit).
    """
    dirs = tower_dirs(checkpoint)
    q_encode = LazyEncoder(dirs["query"], doc_len)
    d_encode = (
        q_encode if dirs["document"] == dirs["query"] else LazyEncoder(dirs["document"], doc_len)
    )
    qkey, dkey = q_encode.key(), d_encode.key()
    texts = [td.data.queries[q] for q in td.dev_qids]
    queries = embed_cached(texts, "query", qkey, q_encode, progress=progress)  # type: ignore[arg-type]
    docs = corpus_vectors(td.data, dkey, d_encode, progress)
    if queries.shape[1] != docs.shape[1]:
        raise InvalidArgument(f"{checkpoint}: query and document towers differ in width")
    return SystemVectors(name, queries, docs)


def exact_scores(vectors: SystemVectors, td: TrainingData) -> Scores:
    top = exact_top(vectors.queries, vectors.docs, DEPTH)
    run = {q: [td.data.doc_ids[j] for j in top[row]] for row, q in enumerate(td.dev_qids)}
    return score(run, td.data.qrels, td.dev_qids)


def dev_pairs(td: TrainingData) -> tuple[list[tuple[int, int]], dict[int, set[int]]]:
    row_of = {d: i for i, d in enumerate(td.data.doc_ids)}
    pairs, relevant = [], {}
    for qi, q in enumerate(td.dev_qids):
        rows = sorted(row_of[d] for d in td.data.qrels[q])
        relevant[qi] = set(rows)
        pairs += [(qi, r) for r in rows]
    return pairs, relevant


def entropy(vectors: SystemVectors, td: TrainingData, temperature: float = TEMPERATURE) -> float:
    pairs, relevant = dev_pairs(td)
    negatives = min(NEGATIVES, vectors.docs.shape[0] - 1 - max(len(r) for r in relevant.values()))
    return contrastive_entropy(
        vectors.queries,
        vectors.docs,
        pairs,
        relevant,
        negatives=max(1, negatives),
        temperature=temperature,
    )


def means(scores: Scores) -> dict[str, float]:
    return {name: round(value, 4) for name, value in scores.means().items()}


def dev_metrics(
    checkpoint: Path,
    td: TrainingData,
    progress: bool = True,
    doc_len: int | None = None,
) -> dict[str, Any]:
    """The manifest's dev figures: exact-search measures and contrastive entropy."""
    vectors = system_vectors(Path(checkpoint).name, checkpoint, td, progress, doc_len)
    out: dict[str, Any] = means(exact_scores(vectors, td))
    out["contrastive_entropy"] = round(entropy(vectors, td), 4)
    out["queries"] = len(td.dev_qids)
    out["search"] = f"exact inner product over {len(td.data.doc_ids)} documents"
    out["doc_len"] = doc_len or "serving"
    return out


def probe_points(vectors: SystemVectors, td: TrainingData) -> tuple[np.ndarray, np.ndarray]:
    """Balanced (queries, one judged document each) points and their 0/1 labels."""
    pairs, _ = dev_pairs(td)
    first: dict[int, int] = {}
    for q, d in pairs:
        first.setdefault(q, d)
    qrows = sorted(first)
    x = np.concatenate([vectors.queries[qrows], vectors.docs[[first[q] for q in qrows]]])
    y = np.concatenate([np.zeros(len(qrows)), np.ones(len(qrows))])
    return x, y


def separability(vectors: SystemVectors, td: TrainingData, seed: int = 0) -> float:
    """5-fold cross-validated accuracy of a logistic regression: query vs document."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score

    x, y = probe_points(vectors, td)
    folds = StratifiedKFold(n_splits=5, shuffle=True, random_state=seed)
    probe = LogisticRegression(max_iter=2000, C=1.0)
    return float(np.mean(cross_val_score(probe, x, y, cv=folds)))


def plot_projection(
    vectors: SystemVectors,
    td: TrainingData,
    path: Path,
    title: str,
    seed: int = 0,
) -> None:
    """t-SNE of the probe's points: queries and documents in two colours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.manifold import TSNE

    x, y = probe_points(vectors, td)
    xy = TSNE(
        n_components=2, perplexity=min(30.0, (len(x) - 1) / 3), init="pca", random_state=seed
    ).fit_transform(x)
    fig, ax = plt.subplots(figsize=(5, 5))
    for label, colour, name in ((0, "C0", "queries"), (1, "C1", "documents")):
        ax.scatter(xy[y == label, 0], xy[y == label, 1], s=8, c=colour, label=name, alpha=0.7)
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _variant_key(arch: str) -> str:
    return arch.replace("-", "_")


def _system_report(
    vectors: SystemVectors,
    td: TrainingData,
    scores: Scores,
    plots: Path | None,
    title: str,
) -> dict[str, Any]:
    row: dict[str, Any] = means(scores)
    row["contrastive_entropy"] = round(entropy(vectors, td), 4)
    row["separability"] = round(separability(vectors, td), 4)
    if plots is not None:
        path = plots / f"{vectors.name}.png"
        plot_projection(vectors, td, path, f"{title}: probe accuracy {row['separability']:.3f}")
        row["projection_png"] = str(path)
    return row


def _comparable_manifests(checkpoints: list[Path]) -> list[dict[str, Any]]:
    """The checkpoints' manifests; InvalidArgument unless every training is complete and
    they share their base checkpoint and dev split."""
    from services.encoder.train.manifest import read_manifest

    if not checkpoints:
        raise InvalidArgument("give at least one --encoder checkpoint")
    manifests = [read_manifest(c) for c in checkpoints]
    first = manifests[0]
    for path, m in zip(checkpoints, manifests, strict=True):
        if not m.get("complete"):
            raise InvalidArgument(f"{path}: training is not complete (resume it first)")
        for field in ("base_checkpoint", "dev_split"):
            if m[field] != first[field]:
                raise InvalidArgument(
                    f"{path}: another {field.replace('_', ' ')} than "
                    f"{checkpoints[0]}: not comparable"
                )
    return manifests


def _variant_row(
    path: Path,
    manifest: dict[str, Any],
    vectors: SystemVectors,
    td: TrainingData,
    scores: Scores,
    base_scores: Scores,
    plots: Path | None,
) -> dict[str, Any]:
    """One trained checkpoint's row: its measures, its paired nDCG@10 difference from the
    base, and what its training cost."""
    from services.measures.ranking import paired_comparison

    row = _system_report(vectors, td, scores, plots, manifest["arch"])
    paired = paired_comparison(base_scores.values("ndcg_at_10"), scores.values("ndcg_at_10"))
    timing = manifest["timing"]
    row.update(
        {
            "checkpoint": str(path),
            "paired_low": paired["ci95"][0],
            "paired_high": paired["ci95"][1],
            "ndcg_at_10_diff": paired["mean_diff"],
            "wins": paired["wins"],
            "losses": paired["losses"],
            "p_value": paired["p_value"],
            "train_seconds": timing.get("train_seconds"),
            "train_wall_seconds": timing.get("wall_seconds"),
            "train_cpu_seconds": timing.get("cpu_seconds"),
            "train_peak_rss_mib": timing.get("peak_rss_mib"),
            "steps": manifest["steps"],
            "recipe": manifest["recipe"],
        }
    )
    return row


def compare(
    data_dir: Path,
    checkpoints: list[Path],
    plots: Path | None = None,
    doc_len: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The base checkpoint and each trained one on the trainers' dev split, side by side.

    Every checkpoint must come from ``encoder train`` on the same data (digest), base and
    dev split; ``doc_len`` defaults to the one their own evaluation used.
    """
    from services.encoder.train.data import eval_corpus, load_training_data
    from services.measures.ranking import paired_comparison

    manifests = _comparable_manifests(checkpoints)
    first = manifests[0]
    split = first["dev_split"]
    td = load_training_data(data_dir, split["seed"], split["dev_fraction"])
    if td.digest != first["data"]["digest"]:
        raise InvalidArgument(f"{data_dir} is not the data the checkpoints were trained on")
    if td.dev_qids != split["dev_qids"]:
        raise InvalidArgument("the dev split recomputed from the seed differs from the manifest")
    if doc_len is None:
        used = {m.get("dev", {}).get("doc_len") for m in manifests} - {None, "serving"}
        doc_len = int(used.pop()) if len(used) == 1 else None
    sizes = {m.get("dev", {}).get("eval_corpus") for m in manifests}
    if len(sizes) > 1:
        raise InvalidArgument("the checkpoints were evaluated on different corpus samples")
    corpus_size = sizes.pop()
    td = eval_corpus(td, corpus_size, split["seed"])
    base_dir = Path(first["base_checkpoint"]["path"])
    base_vectors = system_vectors("base", base_dir, td, progress, doc_len)
    base_scores = exact_scores(base_vectors, td)
    report: dict[str, Any] = {
        "data": str(data_dir),
        "dev_queries": len(td.dev_qids),
        "dev_qids_digest": split["dev_qids_digest"],
        "search": f"exact inner product over {len(td.data.doc_ids)} documents",
        "doc_len": doc_len or "serving",
        "eval_corpus": corpus_size or "all",
        "base": {
            "checkpoint": first["base_checkpoint"]["name"],
            **_system_report(base_vectors, td, base_scores, plots, "base"),
            "train_seconds": 0.0,
        },
        "variants": {},
    }
    per_query: dict[str, list[float]] = {}
    for path, m in zip(checkpoints, manifests, strict=True):
        name = _variant_key(m["arch"])
        vectors = system_vectors(name, path, td, progress, doc_len)
        scores = exact_scores(vectors, td)
        per_query[name] = scores.values("ndcg_at_10")
        report["variants"][name] = _variant_row(path, m, vectors, td, scores, base_scores, plots)
    # The paper's questions: each variant against SDE, and ADE-SPL against plain ADE.
    wanted = [(a, "sde") for a in per_query if a != "sde"] + [("ade_spl", "ade")]
    report["pairs"] = {
        f"{a} - {b}": paired_comparison(per_query[b], per_query[a])
        for a, b in wanted
        if a in per_query and b in per_query
    }
    return report


def table(report: dict[str, Any]) -> str:
    """The comparison as a fixed-width table (one row per system)."""
    head = (
        f"{'system':<10} {'nDCG@10':>8} {'diff [95% CI]':>24} {'R@100':>7} {'MRR@10':>7} "
        f"{'CE':>6} {'sep':>6} {'train s':>8}"
    )
    lines = [
        f"dev: {report['dev_queries']} queries, {report['search']}, documents at "
        f"{report['doc_len']} tokens",
        head,
    ]
    rows = [("base", report["base"]), *report["variants"].items()]
    for name, r in rows:
        diff = (
            f"{r['ndcg_at_10_diff']:+.4f} [{r['paired_low']:+.4f}, {r['paired_high']:+.4f}]"
            if "paired_low" in r
            else ""
        )
        lines.append(
            f"{name:<10} {r['ndcg_at_10']:>8.4f} {diff:>24} {r['recall_at_100']:>7.4f} "
            f"{r['mrr_at_10']:>7.4f} {r['contrastive_entropy']:>6.3f} {r['separability']:>6.3f} "
            f"{r['train_seconds'] or 0:>8.0f}"
        )
    for pair, c in report.get("pairs", {}).items():
        lines.append(
            f"nDCG@10 {pair}: {c['mean_diff']:+.4f} [{c['ci95'][0]:+.4f}, "
            f"{c['ci95'][1]:+.4f}] ({c['wins']} wins, {c['losses']} losses)"
        )
    return "\n".join(lines)
