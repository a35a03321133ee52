"""What a training run records as it goes: the dev pool's nDCG@10 (the curve), the
resumable trainer state, the checkpoint's manifest, the curve's plot, and the process's
resource use.

Every ``eval_every`` steps the dev nDCG@10 is measured on a pool (the base model's top
``dev_pool_depth`` of each dev query plus its judged documents, re-encoded by the
current towers) — cheap enough to plot; the manifest's dev metrics are exact search
over the whole corpus with the saved checkpoint (:mod:`services.encoder.train.evaluate`).
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.encoder.model import model_name_of
from services.encoder.textcodec import TextCodec
from services.encoder.train.config import TrainConfig
from services.encoder.train.data import TrainingData, ids_digest, model_key
from services.encoder.train.steps import forward
from services.encoder.train.towers import Arch, Towers, is_asymmetric
from services.measures.ranking import score

TRAINER_STATE = "trainer_state.pt"
CURVE_PNG = "training.png"


class DevPool:
    """nDCG@10 of the current towers on the dev queries, ranking a fixed document pool."""

    def __init__(self, td: TrainingData, ranks: dict[str, list[str]]) -> None:
        self.td = td
        pool = {d for q in td.dev_qids for d in ranks[q]}
        pool |= {d for q in td.dev_qids for d in td.data.qrels[q]}
        self.doc_ids = sorted(pool)

    @torch.no_grad()
    def ndcg(self, towers: Towers, codec: TextCodec, batch: int = 64) -> float:
        towers.train(False)
        try:
            data = self.td.data
            docs = torch.cat(
                [
                    forward(
                        towers.document,
                        codec.encode(
                            [data.docs[d] for d in self.doc_ids[i : i + batch]], "document"
                        ),
                    )
                    for i in range(0, len(self.doc_ids), batch)
                ]
            )
            qs = torch.cat(
                [
                    forward(
                        towers.query,
                        codec.encode(
                            [data.queries[q] for q in self.td.dev_qids[i : i + batch]], "query"
                        ),
                    )
                    for i in range(0, len(self.td.dev_qids), batch)
                ]
            )
            sims = (qs @ docs.T).numpy()
            top = np.argsort(-sims, axis=1, kind="stable")[:, :10]
            run = {q: [self.doc_ids[j] for j in top[r]] for r, q in enumerate(self.td.dev_qids)}
            return score(run, data.qrels, self.td.dev_qids).mean("ndcg_at_10")
        finally:
            towers.train(True)


def usage() -> dict[str, float]:
    """This process's CPU seconds so far and its peak resident memory (MiB)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_seconds": ru.ru_utime + ru.ru_stime, "peak_rss_mib": ru.ru_maxrss / 1024}


def save_state(
    out: Path,
    towers: Towers,
    opt: Any,
    sched: Any,
    cfg: TrainConfig,
    arch: str,
    step: int,
    losses: list[float],
    curve: list[dict[str, Any]],
    train_seconds: float,
) -> None:
    """``trainer_state.pt``: what a resumed run needs (written whole, then renamed)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {
        "towers": towers.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "step": step,
        "losses": losses,
        "curve": curve,
        "recipe": cfg.recipe(),
        "arch": arch,
        "train_seconds": train_seconds,
    }
    tmp = out / f"{TRAINER_STATE}.tmp"
    torch.save(state, tmp)
    tmp.replace(out / TRAINER_STATE)


def build_manifest(
    cfg: TrainConfig,
    arch: Arch,
    base: Path,
    td: TrainingData,
    towers: Towers,
    dim: int,
    step: int,
    steps: int,
    losses: list[float],
    curve: list[dict[str, Any]],
    dev: dict[str, Any],
    timing: dict[str, Any],
) -> dict[str, Any]:
    """The checkpoint's ``manifest.json`` at ``step`` of ``steps``."""
    return {
        "arch": arch,
        "complete": step >= steps,
        "towers": {"query": "query", "document": "document"}
        if is_asymmetric(arch)
        else {"query": ".", "document": "."},
        "added_projection": towers.added_projection,
        "dim": dim,
        "base_checkpoint": {
            "path": str(base),
            "name": model_name_of(base),
            "key": model_key(base),
        },
        "data": {
            "dir": str(cfg.data_dir),
            "split": "train",
            "digest": td.digest,
            "train_pairs": len(td.pairs),
        },
        "dev_split": {
            "seed": cfg.seed,
            "dev_fraction": cfg.dev_fraction,
            "train_queries": len(td.train_qids),
            "dev_queries": len(td.dev_qids),
            "dev_qids": td.dev_qids,
            "dev_qids_digest": ids_digest(td.dev_qids),
        },
        "steps": step,
        "total_steps": steps,
        "recipe": cfg.recipe(),
        "dev": dev,
        "curve": {"loss": [round(v, 5) for v in losses], "dev": curve},
        "timing": timing,
    }


def plot_curve(manifest: dict[str, Any], path: Path) -> None:
    """Training loss (moving mean over 10 steps) and dev pool nDCG@10, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = np.asarray(manifest["curve"]["loss"], dtype=float)
    fig, ax = plt.subplots(figsize=(7, 4))
    if loss.size:
        w = min(10, loss.size)
        smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
        ax.plot(np.arange(1, loss.size + 1), loss, color="0.8", lw=0.8, label="loss")
        ax.plot(np.arange(w, loss.size + 1), smooth, color="C0", label=f"loss (mean of {w})")
    ax.set_xlabel("step")
    ax.set_ylabel("in-batch softmax loss")
    dev = manifest["curve"]["dev"]
    if dev:
        ax2 = ax.twinx()
        pool = [p for p in dev if "dev_pool_ndcg_at_10" in p]
        exact = [p for p in dev if "dev_exact_ndcg_at_10" in p]
        if pool:
            ax2.plot(
                [p["step"] for p in pool],
                [p["dev_pool_ndcg_at_10"] for p in pool],
                "o-",
                color="C1",
                label="dev nDCG@10 (base top-k pool)",
            )
        if exact:
            ax2.plot(
                [p["step"] for p in exact],
                [p["dev_exact_ndcg_at_10"] for p in exact],
                "s",
                color="C3",
                label="dev nDCG@10 (exact, corpus)",
            )
        ax2.set_ylabel("dev nDCG@10")
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    ax.set_title(
        f"{manifest['arch']}: {manifest['steps']} steps, batch {manifest['recipe']['batch_size']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
