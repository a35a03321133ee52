"""The tuning report as a text table (dev nDCG@10, validation nDCG@10, vs serving)."""

from __future__ import annotations

from typing import Any


def table(report: dict[str, Any]) -> str:
    rows = report["systems"]
    width = max(len(n) for n in rows)
    lines = [
        f"{'system':<{width}}  kind         dev nDCG@10  val nDCG@10  vs serving (95 % interval)",
    ]
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["ndcg_at_10"]):
        vs = r["vs_serving"]
        diff = (
            ""
            if vs is None
            else f"{vs['mean_diff']:+.4f} [{vs['ci95'][0]:+.4f}, {vs['ci95'][1]:+.4f}]"
        )
        mark = "" if r["eligible"] else " (over budget)"
        lines.append(
            f"{name:<{width}}  {r['kind']:<11}  {r['ndcg_at_10']:.4f}       "
            f"{r['val_ndcg_at_10']:.4f}       {diff}{mark}"
        )
    best = report["best"]
    lines.append(
        f"best (chosen on validation): {best['system']}  dev nDCG@10 {best['ndcg_at_10']:.4f}; "
        f"best without rerank: {report['best_without_rerank']['system']}"
    )
    return "\n".join(lines)
