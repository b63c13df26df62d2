"""The engine's global batch over training, as a part: its size, the size the LR is set for, the schedule.

:class:`GlobalBatch` owns what a global-batch schedule (:mod:`batchpilot.policy.schedule`) needs
between steps: the global batch now and each rank's share of it, the batch the optimizer's LR was
set for (the schedule's reference), the samples trained on, the step of the last change, and a
warning when the data loader does not follow. The engine asks it what the next global batch is
and applies the change (the LR rescaled, the micro-batch resized). Like ``GradScaler``, what it is
built from is its state: :meth:`GlobalBatch.state_dict` holds the sizes and counters, and a
checkpoint written by an engine of another world size or schedule resumes with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from .._checks import positive_int
from ..policy.schedule import BatchSchedule, SchedulePoint, parse_schedule
from .batching import BatchConfig

__all__ = ["GlobalBatch", "per_rank_batch"]

logger = logging.getLogger(__name__)


def per_rank_batch(global_batch_size: int, world_size: int) -> int:
    """``global // world``, or BatchConfig's error (with the nearest valid global batches).

    Raises:
        ValueError: ``global_batch_size`` is not a multiple of ``world_size``.
    """
    try:
        # BatchConfig owns the arithmetic and its error messages; only the division is checked
        # here, since the engine's micro-batch need not divide the per-rank batch
        BatchConfig(global_batch_size=global_batch_size, world_size=world_size)
    except ValueError as exc:
        raise ValueError(
            f"{exc}. global_batch_size is the batch over all {world_size} ranks; each rank trains on "
            "an equal share of it"
        ) from None
    return global_batch_size // world_size


class GlobalBatch:
    """The global batch of each step, and the schedule that moves it.

    Args:
        global_batch_size: samples per optimizer step over all ranks; with a schedule, the batch the
            optimizer's LR is set for (``reference_batch_size``), where the schedule starts from.
        world_size: data-parallel ranks; each takes ``global_batch_size // world_size`` samples.
        schedule: a :class:`~batchpilot.policy.schedule.BatchSchedule`, its spec (``"adaptive"``), or
            ``None`` for a global batch that moves only by :meth:`resize`.
        uneven: the ranks take uneven shares (:class:`batchpilot.train.shares.RankShares` owns
            them): the global batch need not divide by the world, and :attr:`per_rank` is unused.

    Attributes:
        size: the global batch of the next step.
        per_rank: this rank's share of it.
        world: the ranks.
        reference: the batch the optimizer's LR is set for (the constructor's global batch).
        samples: samples trained on so far, over all ranks.
        last_change: the step after which the global batch last changed (0: never).
        schedule: the schedule, or ``None``.

    Raises:
        ValueError: a global batch that is not a positive int or not a multiple of the world size.
        TypeError: ``schedule`` of another type.
    """

    def __init__(self, global_batch_size: int, *, world_size: int = 1, schedule: BatchSchedule | str | None = None,
                 uneven: bool = False):
        self.size = positive_int("global_batch_size", global_batch_size)
        self.world = positive_int("world_size", world_size)
        # uneven shares (batchpilot.train.shares) need no multiple of the world: each rank's share is its own
        self.per_rank = self.size // self.world if uneven else per_rank_batch(self.size, self.world)
        if isinstance(schedule, str):
            schedule = parse_schedule(schedule)
        if schedule is not None and not isinstance(schedule, BatchSchedule):
            raise TypeError(f"schedule must be a batchpilot.policy.schedule.BatchSchedule or its spec "
                            f"(\"ramp:32,32,10000\"), got {type(schedule).__name__}")
        self.schedule: BatchSchedule | None = schedule
        self.reference = self.size
        self.samples = 0
        self.last_change = 0
        self._short = 0  # batches in a row short of the per-rank batch

    # ------------------------------------------------------------------ sizes
    def check(self, global_batch_size: int) -> int:
        """The per-rank batch of ``global_batch_size`` on this world; nothing changes.

        Raises:
            ValueError: not a positive int, or not a multiple of the world size.
        """
        return per_rank_batch(positive_int("global_batch_size", global_batch_size), self.world)

    def resize(self, global_batch_size: int) -> None:
        """Train on ``global_batch_size`` from the next step (checked as :meth:`check`)."""
        self.per_rank = self.check(global_batch_size)
        self.size = int(global_batch_size)

    def mark_change(self, step: int) -> None:
        """The schedule moved the global batch after ``step``."""
        self.last_change = step

    # ------------------------------------------------------------------ the schedule
    def initial(self) -> int:
        """The global batch the schedule starts at (the reference's without a schedule)."""
        return self.size if self.schedule is None else self.schedule.initial(self.size, self.world)

    def next_size(self, step: int, noise_scale: Callable[[], float | None]) -> int:
        """The global batch after ``step`` steps: the schedule's decision (``noise_scale()`` read only when it asks)."""
        schedule = self.schedule
        if schedule is None:
            return self.size
        point = SchedulePoint(step=step, samples=self.samples, current=self.size, last_change=self.last_change,
                              world=self.world)
        if schedule.reads_noise and schedule.wants_noise(point):
            # every rank reads the same number: its norms were summed over ranks
            point = dataclasses.replace(point, noise_scale=noise_scale())
        return schedule.decide(point, self.reference)

    def count(self, samples: int, *, total: int | None = None) -> None:
        """A step trained on ``samples`` samples on this rank (the same on every rank), or ``total`` over all ranks."""
        self.samples += samples * self.world if total is None else total

    def check_loader(self, samples: int) -> None:
        """Warn when batches stay short of the per-rank batch after a schedule grew it (one short batch is an epoch's end)."""
        if self.schedule is None:
            return
        self._short = self._short + 1 if samples < self.per_rank else 0
        if self._short == 2:
            logger.warning(
                "two batches in a row of %d samples, fewer than this rank's %d: the schedule grew the global "
                "batch but the data loader did not follow; call loader.set_batch_size(engine.per_rank_batch_size) "
                "after each step", samples, self.per_rank,
            )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain numbers and strings (``weights_only=True`` loads them).

        ``global_batch_size`` (over all ranks) and ``world_size`` as saved, ``samples``,
        ``reference_batch_size``, ``last_batch_change``, and ``schedule`` (its
        :meth:`~batchpilot.policy.schedule.BatchSchedule.describe`, or ``None``).
        """
        return {
            "global_batch_size": self.size,
            "world_size": self.world,
            "samples": self.samples,
            "reference_batch_size": self.reference,
            "last_batch_change": self.last_change,
            "schedule": None if self.schedule is None else self.schedule.describe(),
        }

    def load_state_dict(self, state: dict[str, Any], *, per_rank_saved: bool = False) -> int | None:
        """Take the counters of ``state``; with a schedule, the global batch to continue at.

        Without a schedule the global batch stays this one's (a saved one that differs is
        logged) and ``None`` is returned. With one, the saved global batch becomes :attr:`size`
        (what the optimizer's LR is for) and the batch to continue at is returned: the saved one,
        or the one this world size must round it to, which the caller moves to (rescaling the LR
        from the saved one). ``per_rank_saved``: the state's ``global_batch_size`` is a per-rank
        batch (engine states of version 1), which says nothing about the global batch.
        """
        self.samples = int(state.get("samples", 0))
        self.last_change = int(state.get("last_batch_change", 0))
        saved = state.get("global_batch_size")
        if self.schedule is None:
            if not per_rank_saved and saved != self.size:
                logger.warning(
                    "the engine state was saved for a global batch of %s; this engine trains on %d "
                    "(check the learning rate: batchpilot.train.batching.rescale_lr)", saved, self.size,
                )
            return None
        if per_rank_saved:
            return None
        saved = int(saved)
        reference = int(state.get("reference_batch_size", self.reference))
        if reference != self.reference:
            logger.warning("the engine state was saved with global_batch_size=%d as the schedule's reference; "
                           "this engine has %d", reference, self.reference)
        if state.get("schedule") not in (None, self.schedule.describe()):
            logger.warning("the engine state was saved under the %s schedule; continuing under %s",
                           state["schedule"], self.schedule.describe())
        target = self.schedule.for_world(saved, self.reference, self.world)
        self.size = saved  # what the optimizer's LR is for
        if target != saved:
            logger.info("the saved global batch %d does not suit %d rank(s): continuing at %d", saved, self.world,
                        target)
        return target
