"""What ``index rollout | rollback | retire | generations`` decide, apart from their flags
and their words (docs/generations.md).

The CLI (``services/cli/generation_*.py``) parses flags into the calls below and words
their results; every decision is made here: the plan built from a command's options,
whether a rollout starts or resumes (refused, naming the live builder, before anything is
asked), whether its first phase publishes an encoder (the CPU budget then starts after
the publish: the export and Triton's load of the new version run on every CPU), what an
abort left behind, which generations still run though no rollback reaches them, the
generation a retire means, and the rows of ``index generations``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from services.common.encoder_spec import EncoderSpec
from services.common.retrieval_setting import RetrievalSetting
from services.generations.context import RolloutPlan
from services.generations.lifecycle import generation_sizes
from services.generations.registry import Alias, Generation, Registry, describe
from services.generations.state import RolloutState

if TYPE_CHECKING:
    from services.generations.builder import RolloutBuilder
    from services.rpc.tls import ClientTLS

# publishes a checkpoint folder with the CPUs it may use (None: every CPU), serving its
# int8 graphs unmeasured or not (``--int8-unmeasured``, as the plan records it); blocking
PublishOn = Callable[[str, "frozenset[int] | None", bool], EncoderSpec]
Change = Literal["encoder", "retrain", "reembed"]


def plan_of(
    encoder: Path | None,
    shards: int | None,
    retrain: bool,
    retrieval_setting: Path | None = None,
    int8_unmeasured: bool = False,
) -> RolloutPlan:
    """The plan of ``index rollout``'s options: a checkpoint folder to publish (resolved:
    a resume must name the same folder), a shard count (None: the serving one's), a
    retrain, a retrieval setting file for the new generation's record (read and checked
    here, before anything is asked or written: NotFound / InvalidArgument naming it),
    ``--int8-unmeasured`` (recorded with the plan: a resume publishes the same way)."""
    folder = str(encoder.resolve()) if encoder is not None else ""
    setting = None if retrieval_setting is None else RetrievalSetting.load(retrieval_setting)
    return RolloutPlan(
        num_shards=shards,
        retrain=retrain,
        encoder_dir=folder,
        retrieval=setting,
        int8_unmeasured=int8_unmeasured,
    )


@dataclass(frozen=True)
class RolloutIntent:
    """A rollout about to start or resume, before anyone is asked: the plan, the serving
    generation, the recorded rollout it resumes (None: a new one)."""

    plan: RolloutPlan
    serving: Generation
    resumes: RolloutState | None

    @property
    def num_shards(self) -> int:
        """The new generation's shard count (a new rollout's)."""
        return self.plan.num_shards or self.serving.num_shards

    @property
    def change(self) -> Change:
        """What a new rollout changes: a new encoder, the quantizer retrained on the
        stored vectors, or the same encoder re-embedding everything."""
        if self.plan.encoder_dir or self.plan.encoder is not None:
            return "encoder"
        return "retrain" if self.plan.retrain else "reembed"

    @property
    def publishing(self) -> bool:
        """Whether the builder's first phase publishes an encoder (a resume in phase
        ``publish`` publishes the same folder again)."""
        if self.resumes is not None:
            return self.resumes.phase == "publish"
        return bool(self.plan.encoder_dir) and self.plan.encoder is None


def intend_rollout(builder: RolloutBuilder, plan: RolloutPlan) -> RolloutIntent:
    """The rollout ``plan`` asks for; a recorded rollout is resumed, and refused
    (FailedPrecondition) when its builder lives or ``plan`` asks for something else."""
    running = builder.registry.running()
    if running is not None:
        builder.check_resumable(running, plan)
    return RolloutIntent(plan, builder.registry.serving(), running)


def run_rollout(
    make_builder: Callable[[Callable[[str, bool], EncoderSpec] | None], RolloutBuilder],
    intent: RolloutIntent,
    *,
    budget: frozenset[int] | None = None,
    client: Any = None,
    triton_repo: Path | None = None,
    publish: PublishOn | None = None,
) -> Generation:
    """Run the rollout of ``intent`` to its end; the serving generation then.

    ``make_builder(publisher)`` builds the builder with the publish phase's callable
    (None without ``publish``: a rollout that must publish is refused before the lock).
    A CPU ``budget`` (:class:`~services.generations.budget.CpuBudget`, recorded in
    ``client``'s store) holds from the start, or, when the first phase publishes, from
    the end of the publish; it ends with this call."""
    with contextlib.ExitStack() as stack:
        entered: list[bool] = []

        def budgeted() -> None:
            if budget and not entered:
                from services.generations.budget import CpuBudget

                stack.enter_context(CpuBudget(client, budget, triton_repo))
                entered.append(True)

        if not intent.publishing:
            budgeted()
        publisher = None
        if publish is not None:

            def publisher(folder: str, int8_unmeasured: bool) -> EncoderSpec:
                spec = publish(folder, budget, int8_unmeasured)
                budgeted()
                return spec

        builder = make_builder(publisher)
        return asyncio.run(builder.rollout(intent.plan))


@dataclass(frozen=True)
class Aborted:
    """An aborted rollout: its record as it was, and the state its target was left in
    (None: it stopped in phase ``publish``, before its target was recorded)."""

    state: RolloutState
    target_state: str | None


def abort_rollout(builder: RolloutBuilder) -> Aborted:
    """``index rollout --abort`` (:meth:`RolloutBuilder.abort`)."""
    aborted = builder.abort()
    if aborted.phase == "publish":
        return Aborted(aborted, None)
    return Aborted(aborted, builder.registry.get(aborted.target).state)


def displaced(registry: Registry) -> list[Generation]:
    """The generations whose shards still run (state ``previous``) though no rollback
    reaches them any more (the alias names another previous one): a retire frees them."""
    alias = registry.alias()
    return [g for g in registry.all() if g.state == "previous" and g.name != alias.previous]


def retire_choice(registry: Registry, name: str | None) -> str | None:
    """The generation ``index retire`` means (default: the previous one; None when there
    is none, which the retire itself refuses); NotFound for an unknown one, before anyone
    is asked."""
    chosen = name or registry.alias().previous or None
    if chosen is not None:
        registry.get(chosen)
    return chosen


@dataclass(frozen=True)
class Status:
    """``index generations``: the alias, one row per generation (:func:`describe`'s
    fields with the replicas' sizes) and the running rollout's record."""

    alias: Alias
    rows: list[dict[str, Any]]
    rollout: RolloutState | None

    def to_json(self) -> dict[str, Any]:
        return {
            "alias": self.alias.__dict__,
            "generations": self.rows,
            "rollout": None if self.rollout is None else self.rollout.to_json(),
        }


def status(client: Any, tls: ClientTLS | None = None) -> Status:
    """Every generation with its sizes (asked of its replicas over ``tls``)."""

    registry = Registry(client)
    alias = registry.alias()
    base = registry.base_shards()
    rows = []
    for gen in registry.all():
        addresses = registry.addresses(gen.name)
        sizes = generation_sizes(client, gen, base, addresses, tls=tls)
        rows.append(
            describe(gen, alias)
            | {
                "documents": sizes.documents,
                "bytes": sizes.bytes,
                "drift": sizes.drift,
                "log_entries": sizes.log_entries,
                "replicas_up": sizes.replicas_up,
                "replicas": sizes.replicas,
                "addresses": addresses,
            }
        )
    return Status(alias, rows, registry.running())
