"""Pacing a rollout's re-embedding on the serving searches' p99 (issue #33; the design:
docs/generations.md "Pacing on the searches' p99").

On a machine whose cores serve searches, a rollout at full speed makes the searches wait:
not for CPU time, but for a core to be *free* when one of their dozen wake-ups comes (the
measurements behind this are in docs/generations.md). A CPU budget separates the
processes; pacing leaves part of the budget idle. Between two encode calls the builder
pauses so that its encoder is busy ``duty`` of the time: after a call of ``t`` seconds,
``t * (1 / duty - 1)`` seconds.

``duty`` follows the searches' p99 that the gateways report (:mod:`.serving_latency`: their
last 5 s), against a target taken before the rollout began (its ``baseline``, the p99 of the
gateways' 30 s that ended 15 s before, so the rollout's own start is not in it, times
``ratio``, at least ``margin_ms`` more): halved when the p99 is
over the target, raised by a tenth when it is well under (``RELAX``), never below
``min_duty`` (the rollout always progresses, and the writes' dual encodes bound its catch-up
whatever its pace). Only the ``train`` and ``bulk`` phases are paced (:data:`PACED_PHASES`);
a retrain, which encodes nothing, paces each chunk of the vectors it exports and appends
instead (:mod:`.retrain`). A cut is followed by ``settle_s`` without another (the reports
cover the last seconds, which still hold searches from before the cut). A p99 that stays
over the target for ``rebase_after_s`` with the duty at its floor is not the re-embedding's
doing: the target is then taken again from the *lowest* p99 of that time (a *rebase*, as a
latency-based congestion controller re-measures its base delay), so that work the builder
cannot shed does not hold it at a tenth of its pace for the whole rollout, but only by its
margin over that p99; once the p99 is back under the first target's relaxed share, the first
target applies again. A rebase never raises the target past ``ceiling`` times the baseline
(1.5, the most a rollout may slow the searches: docs/generations.md), nor past the first
target when that is higher: when what the rollout cannot shed already takes the p99 there,
the re-embedding stays at its floor rather than add its margin on top. A burst shorter than
that (a target's shard processes starting: ~4 s of two busy cores) only cuts the duty.
Without a baseline (no gateway reported enough searches at the start) nothing is paced."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.generations import serving_latency
from services.generations.progress import Progress

DEFAULT_RATIO = 1.2  # the p99 a rollout may bring the searches to, over the baseline
# ... and the most a rebase may raise that to: the SLO a rollout keeps (issue #33: the
# searches' p99 during a rollout within 1.5x of before). Without it the rebased target
# sat the margin over the p99 the unpaced work made: a bench rollout's baseline 17.5 ms,
# its p99 at the floor 26.4 ms (1.51x), its target rebased to 31.4 ms, and the bulk
# phase, the duty free to climb under it, read 34.5 ms against 30.2 ms in the train phase.
DEFAULT_CEILING = 1.5
MARGIN_MS = 5.0  # ...and at least this much over it (a fast stack's p99 is noise-sized)
MIN_DUTY = 0.1
MIN_SEARCHES = 20  # a report over fewer searches says nothing of a p99
MIN_BASELINE_SEARCHES = 100  # a baseline over fewer falls back to the last window's
CHECK_S = 1.0  # the reports are read this often at most
RELAX = 0.8  # the duty rises only while the p99 is under this share of the target
STEP = 0.1  # ...by this much per check
CUT = 0.5  # and is multiplied by this when the p99 is over the target
# How long the p99 stays over the target, the duty at its floor, before a rebase: three
# report windows. A rebase after one (5 s, until 2026-11-30) took a start-up burst for a
# new base: in a bench rollout the target's shard processes starting (~4 s of two busy
# cores, 2-s windows of p99 94-134 ms) raised the target to 90 ms over a first target of
# 30, and the duty then climbed until the bulk phase read p99 91 ms.
REBASE_AFTER_S = 15.0
# The phases whose encodes are paced: not the catch-up, which must outrun the writes
# whose dual encode failed, nor the switch, whose replay runs with the writes refused.
PACED_PHASES = frozenset({"train", "bulk"})


def slowest_p99(client: Any) -> float | None:
    """The highest p99 of the gateways that reported at least MIN_SEARCHES searches
    lately (None: none did); ``client``: a sync Redis client."""
    reports = serving_latency.read(client)
    p99s = [r.p99_ms for r in reports.values() if r.searches >= MIN_SEARCHES]
    return max(p99s) if p99s else None


def slowest_baseline_p99(client: Any) -> float | None:
    """The highest p99 over the gateways' baseline windows (30 s ending 15 s ago) of those that
    answered at least MIN_BASELINE_SEARCHES there; :func:`slowest_p99` when none did (a
    quiet stack, or gateways that report no baseline)."""
    reports = serving_latency.read(client)
    p99s = [
        r.baseline_p99_ms for r in reports.values() if r.baseline_searches >= MIN_BASELINE_SEARCHES
    ]
    return max(p99s) if p99s else slowest_p99(client)


@dataclass
class PaceFigures:
    """What the pacing did, for the closing report and the bench."""

    baseline_ms: float | None = None
    target_ms: float | None = None
    busy_s: float = 0.0  # the encode calls' time
    paused_s: float = 0.0  # the pauses after them
    cuts: int = 0
    rebases: int = 0  # targets raised: the searches stayed slow with the encoder at its floor
    lowest_duty: float = 1.0

    @property
    def duty(self) -> float:
        """The share of the paced time the encoder was busy."""
        total = self.busy_s + self.paused_s
        return self.busy_s / total if total > 0 else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "baseline_p99_ms": self.baseline_ms,
            "target_p99_ms": self.target_ms,
            "busy_s": round(self.busy_s, 2),
            "paused_s": round(self.paused_s, 2),
            "duty": round(self.duty, 3),
            "cuts": self.cuts,
            "rebases": self.rebases,
            "lowest_duty": round(self.lowest_duty, 3),
        }


class Pacer:
    """Pauses the builder after each encode call (:meth:`after_call`); see the module."""

    def __init__(
        self,
        read: Callable[[], float | None],
        progress: Progress,
        *,
        read_baseline: Callable[[], float | None] | None = None,
        ratio: float = DEFAULT_RATIO,
        ceiling: float = DEFAULT_CEILING,
        margin_ms: float = MARGIN_MS,
        min_duty: float = MIN_DUTY,
        settle_s: float = serving_latency.WINDOW_S,
        rebase_after_s: float = REBASE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self.read = read
        self.read_baseline = read_baseline or read
        self.progress = progress
        self.ratio = ratio
        self.ceiling = ceiling
        self.margin_ms = margin_ms
        self.min_duty = min_duty
        self.settle_s = settle_s
        self.rebase_after_s = rebase_after_s
        self.clock = clock
        self.sleep = sleep
        self.duty = 1.0
        self.active = True  # False: calls pass unpaced (a phase not in PACED_PHASES)
        self.figures = PaceFigures()
        self._checked = float("-inf")
        self._moved = float("-inf")  # the last cut or rebase
        self._first_target = float("inf")  # the target the baseline gave
        self._highest_target = float("inf")  # the most a rebase may raise it to
        # since when the p99 has stayed over the target with the duty at its floor (None:
        # it has not), and the lowest p99 read since
        self._over_since: float | None = None
        self._over_lowest = float("inf")

    def start(self) -> None:
        """Take the baseline: the searches' p99 before this rollout loads the machine."""
        baseline = self.read_baseline()
        self.figures.baseline_ms = baseline
        if baseline is None:
            self.progress.message(
                "pacing: no gateway reported searches, so the re-embedding is not paced"
            )
            return
        target = max(baseline * self.ratio, baseline + self.margin_ms)
        self.figures.target_ms = self._first_target = round(target, 2)
        self._highest_target = round(max(target, baseline * self.ceiling), 2)
        self.progress.message(
            f"pacing: the searches' p99 is {baseline:.1f} ms; the re-embedding slows down "
            f"whenever it passes {target:.1f} ms"
        )

    async def after_call(self, seconds: float) -> None:
        """An encode call of ``seconds`` ended: adjust the duty, then pause for it."""
        if not self.active:
            return
        self.figures.busy_s += seconds
        self._adjust()
        if self.duty < 1.0 and seconds > 0:
            pause = seconds * (1.0 / self.duty - 1.0)
            self.figures.paused_s += pause
            await self.sleep(pause)

    def _adjust(self) -> None:
        target = self.figures.target_ms
        now = self.clock()
        if target is None or now - self._checked < CHECK_S:
            return
        self._checked = now
        p99 = self.read()
        if p99 is None or now - self._moved < self.settle_s:
            return
        if target > self._first_target and p99 < self._first_target * RELAX:
            self.figures.target_ms = target = self._first_target  # what raised it has gone
        if p99 > target and self.duty > self.min_duty:
            self.duty = max(self.min_duty, self.duty * CUT)
            self._moved = now
            self.figures.cuts += 1
            self.figures.lowest_duty = min(self.figures.lowest_duty, self.duty)
            self.progress.message(
                f"pacing: the searches' p99 is {p99:.1f} ms, over {target:.1f} ms: the "
                f"encoder now runs {self.duty:.0%} of the time"
            )
            self._over_since = None
        elif p99 > target:  # at the floor, a settling time on, and still over
            if self._over_since is None:
                self._over_since, self._over_lowest = now, p99
            self._over_lowest = min(self._over_lowest, p99)
            if now - self._over_since >= self.rebase_after_s:
                self._rebase(self._over_lowest, now)
                self._over_since = None
        else:
            self._over_since = None
            if p99 < target * RELAX and self.duty < 1.0:
                self.duty = min(1.0, self.duty + STEP)

    def _rebase(self, p99: float, now: float) -> None:
        """The encoder runs at its floor and the searches stay slow: what slows them is
        not the re-embedding (other work on the machine, the writes' dual encodes, a
        neighbour's steal), and pausing more would only stretch the rollout. The target
        becomes ``p99``, the lowest read at the floor over ``rebase_after_s``, and
        ``margin_ms`` more, at most the ceiling (``ceiling`` times the baseline): the
        re-embedding may speed up again only while the searches are faster than that,
        until the p99 falls back under the first target's relaxed share. At the ceiling
        it stays at its floor while the p99 does not fall. (Until 2026-11-30 it was
        ``ratio`` times the p99 at the floor: the duty then climbed back until the
        re-embedding added the whole ratio again on top of what the rollout could not
        shed; bench rollouts' targets ended at 48-68 ms over first targets of 25-33.)"""
        wanted = max(self._first_target, p99 + self.margin_ms)
        target = round(min(wanted, self._highest_target), 2)
        self._moved = now
        if self.figures.target_ms is not None and target <= self.figures.target_ms:
            return  # at the ceiling already: nothing to raise, nothing new to say
        self.figures.target_ms = target
        self.figures.rebases += 1
        if target < wanted:
            self.progress.message(
                f"pacing: at {self.duty:.0%} the searches' p99 is still {p99:.1f} ms, so the "
                f"re-embedding is not what slows them; the target is now {target:.1f} ms, "
                f"the rollout's ceiling ({self.ceiling:g} x the baseline), and the "
                "re-embedding stays at its floor while the searches are slower than that"
            )
            return
        self.progress.message(
            f"pacing: at {self.duty:.0%} the searches' p99 is still {p99:.1f} ms, so the "
            f"re-embedding is not what slows them: the target is now {target:.1f} ms"
        )
