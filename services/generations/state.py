"""A rollout's state: one typed record, read from and written to ``{gtr}:rollout`` here only.

The builder used to carry the hash as a ``dict[str, str]`` and each phase parsed the fields
it needed (``json.loads(state["positions"])``); a field misspelt or a number left a
string was found at run time, in the middle of a rollout. :class:`RolloutState` is the
record (frozen: a phase returns a new one), :class:`RolloutStore` the only code that turns
it into the hash and back, and the only writer of the hash besides the lock's script.

The hash keeps the field names and encodings older builders wrote (JSON for the maps, the
plan and the SCAN cursor; ``repr`` for times), so a rollout a previous release started
resumes; ``version`` is the record's format (:data:`FORMAT_VERSION`; absent = 1).

Who runs the rollout (``owner``, ``host``, ``pid``, ``beat``) is written by
:meth:`RolloutStore.claim` and :meth:`RolloutStore.beat` only: :meth:`RolloutStore.save`
writes the progress fields and leaves the heartbeat alone, so a save never moves the
heartbeat back.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from services.common.encoder_spec import EncoderSpec
from services.common.errors import FailedPrecondition
from services.common.retrieval_setting import RetrievalSetting
from services.index.keys import NEXT_GENERATION_KEY, ROLLOUT_KEY
from services.index.records import text_of
from services.process.redis_client import SyncRedis

FORMAT_VERSION = 1
# The phases in order; "done" ends the machine (the lock is released).
PHASES: tuple[str, ...] = ("publish", "create", "p0", "train", "bulk", "catch_up", "switch")
DONE = "done"
Kind = Literal["rollout", "rollback"]
# encode: re-embed with the target's encoder; retrain: the source's vectors (same
# encoder); replay: a rollback (only the logs since the switch are replayed)
Mode = Literal["encode", "retrain", "replay"]
# Fields that say who runs the rollout: claim() and beat() write them, save() never.
CLAIM_FIELDS = frozenset({"owner", "host", "pid", "beat"})

# The rollout lock and its fields in one step; ARGV[1] the target ("" = the next name).
_BEGIN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local target = ARGV[1]
if target == '' then target = 'g' .. redis.call('INCR', KEYS[2]) end
redis.call('HSET', KEYS[1], 'target', target, unpack(ARGV, 2))
return target
"""


class Takeover(FailedPrecondition):
    """Another builder took this rollout over (this one was silent too long), or it was
    aborted: this builder stops."""


@dataclass(frozen=True)
class ScanCursor:
    """Where the SCAN of the source's documents goes on: the node (a cluster's primaries
    in name order), its SCAN cursor, how many nodes there were (another count: scan
    again) and whether the SCAN is over."""

    node: int = 0
    cursor: int = 0
    nodes: int = 0
    finished: bool = False

    @classmethod
    def done(cls) -> ScanCursor:
        return cls(finished=True)

    def dump(self) -> str:
        return _j(
            {
                "node": self.node,
                "cursor": self.cursor,
                "nodes": self.nodes,
                "finished": self.finished,
            }
        )

    @classmethod
    def load(cls, raw: str) -> ScanCursor:
        if not raw:
            return cls()
        d = json.loads(raw)
        return cls(int(d["node"]), int(d["cursor"]), int(d["nodes"]), bool(d["finished"]))


@dataclass(frozen=True)
class RecordedPlan:
    """What the rollout was asked for, as recorded under the lock: the encoder (None while
    ``--encoder``'s checkpoint is being published), the shard count, whether the source's
    vectors are reused, the checkpoint folder (a resume must name the same), the retrieval
    setting the target's record gets (None: none, the gateway's flags serve it)."""

    encoder: EncoderSpec | None = None
    shards: int = 0
    retrain: bool = False
    encoder_dir: str = ""
    retrieval: RetrievalSetting | None = None
    int8_unmeasured: bool = False  # ``--int8-unmeasured``: the publish (again, on a resume)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "encoder": None if self.encoder is None else asdict(self.encoder),
            "shards": self.shards,
            "retrain": self.retrain,
            "encoder_dir": self.encoder_dir,
        }
        if self.retrieval is not None:  # absent: the plan as older builders wrote it
            out["retrieval"] = self.retrieval.to_dict()
        if self.int8_unmeasured:  # absent: not asked (and the plan as older builders wrote it)
            out["int8_unmeasured"] = True
        return out

    def dump(self) -> str:
        return _j(self.to_dict())

    @classmethod
    def load(cls, raw: str) -> RecordedPlan | None:
        if not raw:
            return None
        d = json.loads(raw)
        enc = d.get("encoder")
        setting = d.get("retrieval")
        return cls(
            EncoderSpec(**enc) if enc else None,
            int(d.get("shards") or 0),
            bool(d.get("retrain")),
            str(d.get("encoder_dir") or ""),
            None if setting is None else RetrievalSetting.from_dict(setting),
            bool(d.get("int8_unmeasured")),
        )


@dataclass(frozen=True)
class RolloutState:
    """The running rollout (or rollback): every field the phases read and save.

    ``p0`` are the source's log tails the replay starts from, ``positions`` how far each
    shard's log is replayed, ``replayed`` how many entries each, ``added0`` the logs'
    entries-added counts at P0 (the lag is counted from them); ``cursor``, ``done`` and
    ``total`` are the bulk SCAN's progress. A rollback records ``target_state``, the
    state its target goes back to on an abort.
    """

    target: str
    source: str = ""
    kind: Kind = "rollout"
    mode: Mode = "encode"
    phase: str = "create"
    plan: RecordedPlan | None = None
    started_at: float = 0.0
    owner: str = ""
    host: str = ""
    pid: int | None = None
    beat: float = 0.0
    target_state: str = ""
    p0: dict[int, str] = field(default_factory=dict)
    positions: dict[int, str] = field(default_factory=dict)
    replayed: dict[int, int] = field(default_factory=dict)
    added0: dict[int, int] = field(default_factory=dict)
    cursor: ScanCursor = field(default_factory=ScanCursor)
    done: int = 0
    total: int = 0
    version: int = FORMAT_VERSION

    def with_(self, **changes: Any) -> RolloutState:
        """A copy with ``changes`` (the phases' one way to move the record on)."""
        return replace(self, **changes)

    @property
    def runs_here(self) -> bool:
        """True when the recorded builder runs on this host (its pid tells if it lives)."""
        return self.host == socket.gethostname() and self.pid is not None

    def to_json(self) -> dict[str, Any]:
        """The record as JSON-ready values (``index generations --json``, bench): the
        maps keyed by shard number, the plan and the cursor as objects."""
        out = asdict(replace(self, plan=None))
        out["plan"] = None if self.plan is None else self.plan.to_dict()
        return out

    def to_fields(self) -> dict[str, str]:
        """The hash's fields (the encodings older builders wrote)."""
        out = {
            "version": str(self.version),
            "target": self.target,
            "source": self.source,
            "kind": self.kind,
            "mode": self.mode,
            "phase": self.phase,
            "started_at": repr(self.started_at),
            "owner": self.owner,
            "host": self.host,
            "pid": "" if self.pid is None else str(self.pid),
            "beat": repr(self.beat),
        }
        if self.plan is not None:
            out["plan"] = self.plan.dump()
        if self.target_state:
            out["target_state"] = self.target_state
        if self.p0 or self.positions or self.replayed or self.added0:
            out |= {
                "p0": _j(self.p0),
                "positions": _j(self.positions),
                "replayed": _j(self.replayed),
                "added0": _j(self.added0),
            }
        if self.cursor != ScanCursor() or self.done or self.total:
            out |= {"cursor": self.cursor.dump(), "done": str(self.done), "total": str(self.total)}
        return out

    @classmethod
    def from_fields(cls, raw: Mapping[str, str]) -> RolloutState:
        """The record of a hash (fields missing take their defaults: a lock taken with
        a few fields, as tests and older releases do, still reads)."""
        pid = raw.get("pid", "")
        kind = raw.get("kind") or "rollout"
        mode = raw.get("mode") or ("replay" if kind == "rollback" else "encode")
        return cls(
            target=raw.get("target", ""),
            source=raw.get("source", ""),
            kind="rollback" if kind == "rollback" else "rollout",
            mode=mode if mode in ("encode", "retrain", "replay") else "encode",  # type: ignore[arg-type]
            phase=raw.get("phase") or "create",
            plan=RecordedPlan.load(raw.get("plan", "")),
            started_at=float(raw.get("started_at") or 0.0),
            owner=raw.get("owner", ""),
            host=raw.get("host", ""),
            pid=int(pid) if pid.isdigit() else None,
            beat=float(raw.get("beat") or 0.0),
            target_state=raw.get("target_state", ""),
            p0=_positions(raw.get("p0", "")),
            positions=_positions(raw.get("positions", "")),
            replayed=_counts(raw.get("replayed", "")),
            added0=_counts(raw.get("added0", "")),
            cursor=ScanCursor.load(raw.get("cursor", "")),
            done=int(raw.get("done") or 0),
            total=int(raw.get("total") or 0),
            version=int(raw.get("version") or 1),
        )


class RolloutStore:
    """``{gtr}:rollout``: the lock and the one :class:`RolloutState` behind it."""

    def __init__(self, client: SyncRedis) -> None:
        self.redis = client

    def _fields(self) -> dict[str, str] | None:
        """The hash as it is; None: no rollout."""
        got: Mapping[Any, Any] = self.redis.hgetall(ROLLOUT_KEY)  # type: ignore[assignment]
        return {text_of(k): text_of(v) for k, v in got.items()} or None

    def load(self) -> RolloutState | None:
        raw = self._fields()
        return None if raw is None else RolloutState.from_fields(raw)

    def begin(self, fields_: Mapping[str, str]) -> str | None:
        """Take the lock with ``fields_`` in the same step (no reader sees a lock without
        them); without a ``target`` the next generation name is taken in that step too,
        so a refused rollout uses none up. The target's name, None when the lock is
        taken already."""
        rest = [x for k, v in fields_.items() if k != "target" for x in (k, v)]
        target = self.redis.eval(  # type: ignore[no-untyped-call]
            _BEGIN, 2, ROLLOUT_KEY, NEXT_GENERATION_KEY, fields_.get("target", ""), *rest
        )
        return None if target is None else text_of(target)

    def start(self, state: RolloutState) -> RolloutState | None:
        """Take the lock for ``state`` (its ``target`` "" = the next name); the state as
        recorded (with its target), None when another rollout holds the lock."""
        name = self.begin(state.to_fields() | ({} if state.target else {"target": ""}))
        return None if name is None else state.with_(target=name)

    def owner(self) -> str | None:
        raw = self.redis.hget(ROLLOUT_KEY, "owner")
        return None if raw is None else text_of(raw)  # type: ignore[arg-type]

    def claim(self, state: RolloutState, owner: str) -> RolloutState:
        """This process runs the rollout from now on (a resume, a takeover)."""
        now = state.with_(owner=owner, host=socket.gethostname(), pid=os.getpid(), beat=time.time())
        self.redis.hset(ROLLOUT_KEY, mapping={k: now.to_fields()[k] for k in CLAIM_FIELDS})
        return now

    def beat(self, owner: str) -> bool:
        """Renew the heartbeat while ``owner`` runs the rollout; False when it does not."""
        if self.owner() != owner:
            return False
        self.redis.hset(ROLLOUT_KEY, "beat", repr(time.time()))
        return True

    def save(self, state: RolloutState) -> RolloutState:
        """Record ``state``'s progress; :class:`Takeover` when its owner no longer runs
        the rollout (taken over, aborted)."""
        if self.owner() != state.owner:
            raise Takeover(
                f"the rollout to {state.target} was taken over or aborted: this builder stops"
            )
        progress: dict[Any, Any] = {
            k: v for k, v in state.to_fields().items() if k not in CLAIM_FIELDS
        }
        self.redis.hset(ROLLOUT_KEY, mapping=progress)
        return state

    def end(self) -> None:
        self.redis.delete(ROLLOUT_KEY)


def _j(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _positions(raw: str) -> dict[int, str]:
    return {int(s): str(p) for s, p in json.loads(raw).items()} if raw else {}


def _counts(raw: str) -> dict[int, int]:
    return {int(s): int(n) for s, n in json.loads(raw).items()} if raw else {}


__all__ = [
    "DONE",
    "FORMAT_VERSION",
    "PHASES",
    "RecordedPlan",
    "RolloutState",
    "RolloutStore",
    "ScanCursor",
    "Takeover",
]
