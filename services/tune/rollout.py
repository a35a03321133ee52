"""What of ``tune``'s best system a rollout carries: the generation's retrieval setting
(:class:`services.common.retrieval_setting.RetrievalSetting`, docs/generations.md
"Retrieval setting"), written as ``RUN/rollout_setting.json`` for ``index rollout
--encoder <its encoder> --retrieval-setting RUN/rollout_setting.json``.

A system's setting (``report.json`` ``systems.*.setting``) names its encoder checkpoint,
its mode, its fusion (method, ``rrf_k`` or ``dense_weight``, candidates) and, reranked, the
reranker's checkpoint folder, depth and weight. The generation records the fusion, the
candidates, the depth, the weight and the reranker by **name**: the checkpoint folder's
name, which the rerank service serves when started with ``--checkpoint-dir RUN/rerankers``
(or with the folder copied under its own directory). The encoder is the rollout's
``--encoder``; the mode is not recorded (a generation's setting chooses how to fuse, the
gateway's ``--default-mode`` whether): a best system that is not hybrid says so in the
note, and its fusion is the default one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.common.fusion import DEFAULT_RRF_K, Fusion, Method
from services.common.retrieval_setting import RetrievalSetting


def rollout_setting(system: str, setting: Mapping[str, Any]) -> RetrievalSetting:
    """The generation's retrieval setting of ``tune``'s system ``system`` (its report
    setting ``setting``); InvalidArgument when a value is out of the setting's ranges."""
    fusion = dict(setting.get("fusion") or {})
    checkpoint = setting.get("rerank_checkpoint") or ""
    mode = setting.get("mode") or "hybrid"
    note = f"gtr-retrieval tune: best system {system}"
    if mode != "hybrid":
        note += f" (mode {mode}: the gateway's --default-mode decides the mode, not this)"
    return RetrievalSetting(
        fusion=Fusion(
            Method(fusion.get("method", Method.WEIGHTED.value)),
            int(fusion.get("rrf_k", DEFAULT_RRF_K)),
            float(fusion.get("dense_weight", 0.5)),
        ),
        candidates=int(fusion.get("candidates", 100)),
        rerank_checkpoint=Path(str(checkpoint)).name if checkpoint else "",
        rerank_weight=float(setting.get("rerank_weight", 1.0)),
        rerank_depth=int(setting.get("rerank_depth", 0)),
        note=note,
    )


def rollout_plan(report: Mapping[str, Any], out: Path, setting_file: Path) -> dict[str, Any]:
    """Whether ``tune``'s best system should be rolled out, why, and the ``index rollout``
    arguments that do it (before the flags that say where the stack is).

    Warranted only when the best system is not what serves now and the low end of its
    paired 95 % interval against it is above zero. The encoder is the best system's
    checkpoint (``--encoder``), or, when it is the serving one, ``--retrain`` (a new
    generation with the same encoder, to carry the setting).
    """
    best = report["best"]
    low = best.get("paired_low_vs_serving")
    if best["system"] == report["serving"]:
        warranted, reason = False, "the best system is the one serving now"
    elif low is None or low <= 0:
        warranted = False
        reason = (
            f"the best system's paired 95 % interval against the serving one starts at "
            f"{low}: not above zero"
        )
    else:
        warranted, reason = True, f"paired 95 % interval against the serving one starts at {low}"
    encoder = best["setting"].get("encoder")
    what = ["--encoder", str(encoder)] if encoder else ["--retrain"]
    argv = ["index", "rollout", *what, "--retrieval-setting", str(setting_file), "--yes"]
    checkpoint = best["setting"].get("rerank_checkpoint")
    serve = (
        f"the rerank service must serve {Path(str(checkpoint)).name!r}: start it with "
        f"--checkpoint-dir {Path(str(checkpoint)).parent} (`up --rerank-checkpoint-dir`)"
        if checkpoint
        else ""
    )
    return {"warranted": warranted, "reason": reason, "argv": argv, "reranker": serve}
