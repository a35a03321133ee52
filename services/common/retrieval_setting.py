"""A generation's retrieval setting (issue #35, "fusion chosen, not assumed").

What a search served by one index generation gets when it names no fusion or candidate
depth itself: the fusion (method, RRF ``k``, dense weight) and each list's depth before
fusing, chosen on the dev split for that generation's encoder; and, for a search that
asks for a rerank, which reranker checkpoint scores it, how deep, and how its score is
mixed with the first stage's. It is recorded in the generation's record
(:class:`services.index.records.Generation` ``retrieval``; ``index rollout
--retrieval-setting FILE.json`` writes it), so a rollout of a new encoder carries its own
setting and a rollback brings the old one back with the old encoder. A record without one
(every generation written before it existed) is served with the gateway's flags
(``--fusion``, ``--rrf-k``, ``--dense-weight``, ``--hybrid-candidates``) as before.

The rerank interpolation (``rerank_weight`` w, over the reranked candidates): final
score = w·minmax(rerank score) + (1 − w)·minmax(first-stage score); 1.0 is the
reranker's order alone (what a rerank was before). ``rerank_depth`` 0 keeps the gateway's
rule (the request's depth, else the largest the time left allows).

The file (``to_json`` / ``from_json``, what ``gtr-retrieval tune`` writes)::

    {"version": 1, "fusion": {"method": "weighted", "rrf_k": 60, "dense_weight": 0.6},
     "candidates": 100, "rerank_checkpoint": "celi-hybrid", "rerank_weight": 0.7,
     "rerank_depth": 50, "note": "tuned on scifact dev, 2026-11-29"}

Every field but ``version`` may be left out (its default); unknown fields are refused,
so a misspelt one is not silently the default.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import InvalidArgument, NotFound
from services.common.fusion import Fusion, Method, Mode, RetrievalDefaults
from services.common.limits import LIMITS

FORMAT_VERSION = 1
# Hits from each list before fusing: the gateway's --hybrid-candidates range.
MAX_CANDIDATES = 1000
# A reranker checkpoint's name: one directory name under the rerank service's
# --checkpoint-dir (no separators, no "..", no leading dot: it cannot leave that folder).
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FIELDS = (
    "version",
    "fusion",
    "candidates",
    "rerank_checkpoint",
    "rerank_weight",
    "rerank_depth",
    "note",
)


def check_checkpoint_name(name: str) -> str:
    """``name`` when it is a checkpoint name (:data:`CHECKPOINT_NAME`, not ``.``/``..``);
    InvalidArgument otherwise."""
    if not CHECKPOINT_NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidArgument(
            f"rerank checkpoint {name!r}: a name is 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (a directory under the rerank service's "
            "--checkpoint-dir)"
        )
    return name


@dataclass(frozen=True)
class RetrievalSetting:
    """One generation's retrieval setting (see the module's docstring)."""

    fusion: Fusion = field(default_factory=lambda: Fusion(Method.WEIGHTED))
    candidates: int = 100
    rerank_checkpoint: str = ""  # "": the rerank service's default model
    rerank_weight: float = 1.0  # 1: the reranker's order alone
    rerank_depth: int = 0  # 0: the gateway's rule
    note: str = ""  # free text: how it was chosen (the tune report, the split)
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.version != FORMAT_VERSION:
            raise InvalidArgument(
                f"retrieval setting version {self.version}: this release reads {FORMAT_VERSION}"
            )
        if not 1 <= self.candidates <= MAX_CANDIDATES:
            raise InvalidArgument(
                f"retrieval setting candidates: {self.candidates} is out of range "
                f"1..{MAX_CANDIDATES}"
            )
        w = self.rerank_weight
        if not (math.isfinite(w) and 0.0 <= w <= 1.0):
            raise InvalidArgument(f"retrieval setting rerank_weight: {w} is not in [0, 1]")
        if not 0 <= self.rerank_depth <= LIMITS.max_rerank_depth:
            raise InvalidArgument(
                f"retrieval setting rerank_depth: {self.rerank_depth} is out of range "
                f"0..{LIMITS.max_rerank_depth} (0: the gateway's rule)"
            )
        if self.rerank_checkpoint:
            check_checkpoint_name(self.rerank_checkpoint)

    def defaults(self, mode: Mode) -> RetrievalDefaults:
        """What a search on this generation that names no fusion gets (``mode``: the
        gateway's default mode: the setting chooses how to fuse, not whether)."""
        return RetrievalDefaults(mode, self.fusion, self.candidates)

    # --- the JSON form (the record's field and the file) -----------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "fusion": {
                "method": self.fusion.method.value,
                "rrf_k": self.fusion.rrf_k,
                "dense_weight": self.fusion.dense_weight,
            },
            "candidates": self.candidates,
            "rerank_checkpoint": self.rerank_checkpoint,
            "rerank_weight": self.rerank_weight,
            "rerank_depth": self.rerank_depth,
            "note": self.note,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> RetrievalSetting:
        """The setting of a JSON object; InvalidArgument naming the field that is wrong."""
        if not isinstance(data, dict):
            raise InvalidArgument("retrieval setting: expected a JSON object")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise InvalidArgument(
                f"retrieval setting: unknown field {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(_FIELDS)})"
            )
        raw = data.get("fusion", {})
        if not isinstance(raw, dict) or set(raw) - {"method", "rrf_k", "dense_weight"}:
            raise InvalidArgument(
                "retrieval setting fusion: expected an object of method, rrf_k, dense_weight"
            )
        try:
            method = Method(raw.get("method", Method.WEIGHTED.value))
        except ValueError:
            raise InvalidArgument(
                f"retrieval setting fusion.method: {raw.get('method')!r} is not one of "
                f"{', '.join(m.value for m in Method)}"
            ) from None
        fusion = Fusion(
            method,
            _number(raw, "rrf_k", 60, int, "fusion."),
            _number(raw, "dense_weight", 0.5, float, "fusion."),
        )
        note = data.get("note", "")
        checkpoint = data.get("rerank_checkpoint", "")
        if not isinstance(note, str) or not isinstance(checkpoint, str):
            raise InvalidArgument("retrieval setting: note and rerank_checkpoint are strings")
        return cls(
            fusion=fusion,
            candidates=_number(data, "candidates", 100, int),
            rerank_checkpoint=checkpoint,
            rerank_weight=_number(data, "rerank_weight", 1.0, float),
            rerank_depth=_number(data, "rerank_depth", 0, int),
            note=note,
            version=_number(data, "version", FORMAT_VERSION, int),
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> RetrievalSetting:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise InvalidArgument(f"retrieval setting: not JSON ({exc})") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: Path) -> RetrievalSetting:
        """The setting in the file ``path``: NotFound when there is none, InvalidArgument
        (naming the file) when it is not a valid setting."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise NotFound(f"{path}: no such retrieval setting file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"{path}: unreadable ({exc})") from None
        try:
            return cls.from_json(text)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{path}: {exc.message}") from None

    def write(self, path: Path) -> Path:
        """Write the file ``path`` (what ``gtr-retrieval tune`` calls)."""
        path = Path(path)
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    def describe(self) -> str:
        """One line for ``index generations``."""
        f = self.fusion
        fusion = f"rrf k={f.rrf_k}" if f.method is Method.RRF else f"weighted {f.dense_weight:g}"
        out = f"{fusion}, {self.candidates} candidates"
        if self.rerank_checkpoint or self.rerank_weight < 1.0 or self.rerank_depth:
            out += (
                f"; rerank {self.rerank_checkpoint or '(default model)'}"
                f" depth {self.rerank_depth or 'auto'} weight {self.rerank_weight:g}"
            )
        return out


def interpolated_order(
    rerank: Sequence[float], first: Sequence[float], weight: float
) -> list[tuple[int, float]]:
    """The rerank interpolation, the one rule the gateway and ``tune`` apply: candidates
    given in first-stage order with their reranker scores ``rerank`` and first-stage
    scores ``first``, each min-max normalised over these candidates (all equal: 1), mixed
    as ``weight``·rerank + (1 − ``weight``)·first; (position, mixed score) best first,
    ties in first-stage order."""
    if len(rerank) != len(first):
        raise ValueError("one rerank score and one first-stage score per candidate")
    if not rerank:
        return []

    def unit(values: Sequence[float]) -> list[float]:
        low, high = min(values), max(values)
        return [1.0] * len(values) if high <= low else [(v - low) / (high - low) for v in values]

    mixed = [
        weight * r + (1.0 - weight) * f for r, f in zip(unit(rerank), unit(first), strict=True)
    ]
    return sorted(enumerate(mixed), key=lambda pair: -pair[1])


def _number(data: dict[str, Any], name: str, default: Any, kind: type, where: str = "") -> Any:
    value = data.get(name, default)
    ok = (
        isinstance(value, int) and not isinstance(value, bool)
        if kind is int
        else isinstance(value, int | float) and not isinstance(value, bool)
    )
    if not ok:
        raise InvalidArgument(
            f"retrieval setting {where}{name}: {value!r} is not "
            + ("an integer" if kind is int else "a number")
        )
    return kind(value)
