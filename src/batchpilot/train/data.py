"""An elastic batch sampler: batch size changes mid-epoch, rank sharding, exact mid-epoch resume.

A batch counts only once it is *marked consumed* (:class:`ElasticLoader` does it as it yields),
so a checkpoint ignores what ``DataLoader`` workers prefetched; the layout of an epoch is
``DistributedSampler``'s. Details: ``docs/internals.md#data``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from .._checks import check_int
from ..core.ranks import known_rank, world_size as _default_world_size
from ..policy.shares import split_shares

__all__ = ["ElasticBatchSampler", "ElasticLoader"]

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
_STATE_KEYS = frozenset(
    {"version", "epoch", "seed", "shuffle", "drop_last", "dataset_size", "num_replicas",
     "batch_size", "consumed"}
)  # fmt: skip


def _default_rank(num_replicas: int) -> int:
    """This rank as :func:`batchpilot.dist.distributed.known_rank` reports it; 0 only for one replica.

    Raises:
        ValueError: No rank is known but ``num_replicas > 1``, or a launcher variable is malformed.
    """
    found = known_rank()
    if found is not None:
        return found
    if num_replicas > 1:
        # Defaulting to 0 here would make every process rank 0 and train on the same shard.
        raise ValueError(
            f"num_replicas is {num_replicas} but no rank is known (no process group, no $RANK or "
            "$SLURM_PROCID); pass rank= explicitly"
        )
    return 0


class ElasticBatchSampler(Sampler[list[int]]):
    """Yields lists of dataset indices for one rank; the batch size may change at any time.

    Use it as ``DataLoader(dataset, batch_sampler=sampler)``, preferably through
    :class:`ElasticLoader`, which reports consumption for you. Every epoch is one pass over a
    permutation drawn from ``(seed, epoch)``, laid out across ranks exactly like
    ``DistributedSampler`` (see the module docstring), so all ranks get the same number of
    samples and take the same number of steps provided they use the same batch size.

    The sampler is a cursor over the epoch. Iterating starts at the last *consumed* sample, not
    the last generated one: batches handed out but not yet passed to :meth:`mark_consumed` (such
    as a ``DataLoader``'s prefetched batches) are served again by the next iteration. Once the
    epoch is fully consumed, a new iteration starts it over in the same order, as
    ``DistributedSampler`` does; call :meth:`set_epoch` each epoch for a new order.

    ``drop_last`` drops both the tail that does not divide by ``num_replicas`` and, on each rank,
    a final batch smaller than the batch size (the two ``drop_last`` flags of ``DistributedSampler``
    and ``DataLoader`` together), so every batch has exactly the batch size it was generated with.
    With ``drop_last=False`` the last batch of the epoch may be smaller, equally on every rank.

    Checkpoints (:meth:`state_dict`) record the epoch and the *global* number of consumed samples:
    ranks advance in lockstep, so ``num_replicas × samples consumed on this rank`` stream positions
    are done, and any rank's state describes the whole job. A run resumed with a different
    ``num_replicas`` continues the epoch from that stream position, re-dealt over the new ranks,
    at the batch size this sampler was constructed with (the saved one was the old world's
    per-rank share; see :meth:`load_state_dict`).

    Args:
        dataset_size: Number of samples, ``len(dataset)``.
        batch_size: Samples per batch on this rank: with :class:`batchpilot.train.engine.Engine`,
            its ``per_rank_batch_size`` (``global_batch_size // num_replicas``).
        shuffle: Draw a new permutation each epoch; else use ``range(dataset_size)``.
        seed: Base seed; the permutation of epoch ``e`` is drawn with seed ``seed + e``. Must be
            the same on every rank.
        drop_last: See above.
        num_replicas: Number of ranks. Default: the initialised process group, else
            ``$WORLD_SIZE``, else ``$SLURM_NTASKS``, else 1.
        rank: This rank. Default: the process group, else ``$RANK``, else ``$SLURM_PROCID``,
            else 0 when ``num_replicas`` is 1.
        shares: Uneven shares of each global batch, one int per rank (``Engine.shares`` of an
            engine built with ``shares=``); ``batch_size`` is then unused. See :meth:`set_shares`.

    Raises:
        ValueError: A size is not a positive int, ``rank`` is outside ``[0, num_replicas)``,
            ``seed`` is not a 64-bit int, or the rank cannot be determined for
            ``num_replicas > 1``.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        shares: list[int] | tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self._dataset_size = check_int(
            "dataset_size", dataset_size, minimum=1, hint="; pass len(dataset) of a non-empty dataset"
        )
        self._batch_size = check_int("batch_size", batch_size, minimum=1)
        self._seed = check_int("seed", seed, minimum=-(2**63))
        if self._seed >= 2**63:
            # torch.Generator takes 64-bit seeds, and seed + epoch must stay one.
            raise ValueError(f"seed must be < 2**63, got {self._seed}")
        self._shuffle = bool(shuffle)
        self._drop_last = bool(drop_last)
        if num_replicas is None:
            num_replicas = _default_world_size()
        self._num_replicas = check_int("num_replicas", num_replicas, minimum=1)
        if rank is None:
            rank = _default_rank(self._num_replicas)
        self._rank = check_int("rank", rank, minimum=0, hint="; ranks count from 0")
        if self._rank >= self._num_replicas:
            raise ValueError(
                f"rank {self._rank} is out of range for num_replicas {self._num_replicas}; "
                f"use a rank in 0..{self._num_replicas - 1} or raise num_replicas"
            )
        self._epoch = 0
        # Global stream position where the current layout over num_replicas ranks begins: 0, or
        # the consumed count of a loaded checkpoint (possibly saved on another number of ranks).
        self._seg_start = 0
        # Samples this rank has consumed since _seg_start.
        self._consumed = 0
        # Sizes of batches handed out and not yet consumed, oldest first (DataLoader keeps order).
        # (samples on this rank, stream positions they advance the cursor by) for each batch
        self._pending: deque[tuple[int, int]] = deque()
        # Bumped whenever the cursor moves under a live iterator, which then stops.
        self._token = 0
        # A loaded checkpoint is resumed by the next iteration even if nothing is left of its epoch.
        self._resume_pending = False
        self._perm_cache: tuple[int, torch.Tensor] | None = None
        # uneven shares of each global batch (one per rank), or None for DistributedSampler's layout
        self._shares: tuple[int, ...] | None = None
        if shares is not None:
            self._shares = self._check_shares(shares)

    @property
    def dataset_size(self) -> int:
        return self._dataset_size

    @property
    def batch_size(self) -> int:
        """Size of the batches generated from now on."""
        return self._batch_size

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def consumed_samples(self) -> int:
        """Stream positions of this epoch consumed, summed over ranks, end-of-epoch pads included."""
        if self._shares is not None:  # the cursor counts stream positions of whole global batches
            return self._seg_start + self._consumed
        return self._seg_start + self._consumed * self._num_replicas

    @property
    def shares(self) -> tuple[int, ...] | None:
        """Each rank's samples per global batch, or ``None`` (equal batches of :attr:`batch_size`)."""
        return self._shares

    def set_shares(self, shares: list[int] | tuple[int, ...] | None) -> None:
        """Deal each global batch unevenly from the next batch on: rank ``r`` takes ``shares[r]`` samples.

        Every global batch of ``sum(shares)`` consecutive stream positions is cut in rank order
        (rank 0 the first ``shares[0]``); an epoch's last, shorter global batch is cut in
        proportion to the shares (at least one sample per rank; pads wrap to the epoch's start
        when fewer samples than ranks are left, as ``DistributedSampler`` pads). The layout
        changes at the consumed cursor, so across any number of changes (and a checkpoint resume
        on another split or world size) every sample of the epoch is served once. Call it on
        every rank alike, with the same shares: :meth:`ElasticLoader.set_shares` after each
        engine step, with ``engine.shares``. ``None`` goes back to equal batches of
        :attr:`batch_size`. A live iteration stops (:class:`ElasticLoader` restarts it).

        Raises:
            ValueError: not one positive int per replica.
        """
        new = None if shares is None else self._check_shares(shares)
        if new == self._shares:
            return
        position = min(self.consumed_samples, self._dataset_size)
        self._shares = new
        self._move_cursor(seg_start=position)
        logger.debug("shares %s from stream position %d", new, position)

    def _check_shares(self, shares: Any) -> tuple[int, ...]:
        items = list(shares)
        if len(items) != self._num_replicas or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in items
        ):
            raise ValueError(
                f"shares must be one positive int per replica ({self._num_replicas}), got {items!r}; "
                "pass engine.shares"
            )
        return tuple(items)

    @property
    def pending_batches(self) -> int:
        """Batches handed out by the current iteration and not yet marked consumed."""
        return len(self._pending)

    @property
    def exhausted(self) -> bool:
        """No batch is left in the current epoch after the consumed cursor, at the current size."""
        return self._batches_left(self._seg_start, self._consumed) == 0

    def set_batch_size(self, batch_size: int) -> None:
        """Use ``batch_size`` for every batch not yet generated.

        Batches already handed out (e.g. prefetched by ``DataLoader`` workers) keep their size;
        consumption is counted per batch, so that is still exact. :meth:`ElasticLoader.set_batch_size`
        also drops the prefetched batches so that the new size applies from the next batch.

        Raises:
            ValueError: ``batch_size`` is not a positive int.
        """
        batch_size = check_int("batch_size", batch_size, minimum=1)
        if batch_size != self._batch_size:
            logger.debug("batch size %d -> %d", self._batch_size, batch_size)
        self._batch_size = batch_size

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` at its first sample; a no-op if already in ``epoch``.

        The no-op keeps the cursor, which is what makes the usual loop resume mid-epoch after
        :meth:`load_state_dict`: ``for e in range(start, n): sampler.set_epoch(e); ...``.

        Raises:
            ValueError: ``epoch`` is not an int >= 0.
        """
        epoch = check_int("epoch", epoch, minimum=0)
        if epoch == self._epoch:
            return
        self._epoch = epoch
        self._move_cursor(seg_start=0)
        self._resume_pending = False

    def mark_consumed(self, num_batches: int = 1) -> int:
        """Record that training used the oldest ``num_batches`` batches handed out.

        Call it once per batch after the training loop received it (before a checkpoint of that
        step). :class:`ElasticLoader` calls it for you. The order is the order the sampler
        generated batches in, which ``DataLoader`` preserves (unless ``in_order=False``).

        Returns:
            The number of samples (on this rank) those batches held.

        Raises:
            ValueError: ``num_batches`` is not a positive int, or exceeds the batches handed out
                and not yet marked.
        """
        num_batches = check_int("num_batches", num_batches, minimum=1)
        if num_batches > len(self._pending):
            raise ValueError(
                f"mark_consumed({num_batches}) but only {len(self._pending)} batch(es) were handed "
                "out by the current iteration and not yet marked; call it once per batch the "
                "training loop received (ElasticLoader does this for you)"
            )
        samples = 0
        for _ in range(num_batches):
            local, advance = self._pending.popleft()
            samples += local
            self._consumed += advance
        return samples

    def __iter__(self) -> Iterator[list[int]]:
        """Start an iteration at the consumed cursor; any earlier iteration stops.

        Batches handed out by an earlier iteration and never marked consumed are forgotten and
        will be generated again, at the current batch size.
        """
        if self.exhausted and not self._resume_pending:
            self._move_cursor(seg_start=0)
        else:
            self._move_cursor(seg_start=self._seg_start, consumed=self._consumed)
        self._resume_pending = False
        return self._generate(self._token)

    def __len__(self) -> int:
        """Batches a new iteration would yield at the current batch size.

        That is the rest of the epoch from the consumed cursor, or a whole epoch if it is done.
        """
        if self.exhausted and not self._resume_pending:
            return self._batches_left(0, 0)
        return self._batches_left(self._seg_start, self._consumed)

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: epoch and consumed samples (global), plus identity checks.

        Only consumed batches count, so a ``DataLoader``'s prefetched batches are served again
        after a resume. ``consumed`` is summed over ranks, so the state of any one rank is the
        state of the job.
        """
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            # Pads past the end carry no information: consumed >= dataset_size means "epoch done".
            "consumed": min(self.consumed_samples, self._dataset_size),
            "batch_size": self._batch_size,
            "dataset_size": self._dataset_size,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "num_replicas": self._num_replicas,
            "shares": None if self._shares is None else list(self._shares),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`, possibly saved with a different ``num_replicas``.

        Restores the epoch and the consumed position. The next iteration yields the rest of that
        epoch, stream positions ``consumed, consumed + 1, ...`` dealt over this sampler's
        ``num_replicas`` ranks (padded or dropped at the end as configured), so across the save
        and the resume every sample of the epoch is served once. ``drop_last`` comes from this
        sampler, not the state. Call it before iterating (it stops a live iteration).

        The batch size is restored only when the state was saved on as many replicas as this
        sampler has. The saved one is the old world's *per-rank* share: after a resize it would
        change the global batch (``8`` per rank on 2 ranks is ``16``; on 1 rank it would be
        ``8``), so the sampler keeps the batch size it was constructed with, which the caller
        derives from the global batch and the new world (``global // num_replicas``).

        Raises:
            ValueError: The state is missing keys, has an unknown version, or was saved for a
                different ``dataset_size``, ``seed`` or ``shuffle`` (its permutation would differ,
                and resuming would skip and repeat samples).
        """
        missing = _STATE_KEYS - state.keys()
        if missing:
            raise ValueError(
                f"not an ElasticBatchSampler state: missing {', '.join(sorted(missing))}; "
                "pass what ElasticBatchSampler.state_dict() returned"
            )
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"sampler state version {state['version']!r} is not supported "
                f"(this batchpilot reads version {_STATE_VERSION})"
            )
        for key, ours in (
            ("dataset_size", self._dataset_size),
            ("seed", self._seed),
            ("shuffle", self._shuffle),
        ):
            if state[key] != ours:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={ours!r}; the epoch permutation would differ and resuming would skip "
                    f"and repeat samples. Construct the sampler with {key}={state[key]!r}, or "
                    "start a fresh epoch without loading this state"
                )
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        saved_replicas = check_int("state['num_replicas']", state["num_replicas"], minimum=1)
        consumed = check_int("state['consumed']", state["consumed"], minimum=0)
        if consumed > self._dataset_size:
            raise ValueError(
                f"state['consumed']={consumed} exceeds dataset_size {self._dataset_size}; "
                "the state is corrupt"
            )
        saved_batch = check_int("state['batch_size']", state["batch_size"], minimum=1)
        if saved_replicas == self._num_replicas:
            self._batch_size = saved_batch
        elif saved_batch != self._batch_size:
            logger.info(
                "keeping batch size %d: the saved %d was the per-rank share on %d replicas, not %d",
                self._batch_size, saved_batch, saved_replicas, self._num_replicas,
            )
        self._epoch = epoch
        self._move_cursor(seg_start=consumed)
        self._resume_pending = True
        logger.info(
            "resuming epoch %d at sample %d of %d (saved on %d replicas, now %d), batch size %d",
            epoch,
            min(consumed, self._dataset_size),
            self._dataset_size,
            saved_replicas,
            self._num_replicas,
            self._batch_size,
        )

    # -- internals -------------------------------------------------------------------------

    def _move_cursor(self, *, seg_start: int, consumed: int = 0) -> None:
        """Set the consumed cursor; live iterators stop and pending batches are forgotten."""
        self._seg_start = seg_start
        self._consumed = consumed
        self._pending.clear()
        self._token += 1

    def _global_batches(self, seg_start: int, consumed: int) -> int:
        """Global batches left under uneven shares from ``consumed`` stream positions into the segment."""
        assert self._shares is not None
        left = self._dataset_size - seg_start - consumed
        if left <= 0:
            return 0
        total = sum(self._shares)
        return left // total if self._drop_last else -(-left // total)

    def _local_length(self, seg_start: int) -> int:
        """Samples this rank gets in the segment that starts at stream position ``seg_start``."""
        left = max(self._dataset_size - seg_start, 0)
        if self._drop_last:
            return left // self._num_replicas
        return -(-left // self._num_replicas)

    def _batches_left(self, seg_start: int, consumed: int) -> int:
        if self._shares is not None:
            return self._global_batches(seg_start, consumed)
        left = self._local_length(seg_start) - consumed
        if left <= 0:
            return 0
        if self._drop_last:
            return left // self._batch_size
        return -(-left // self._batch_size)

    def _permutation(self) -> torch.Tensor:
        if self._perm_cache is None or self._perm_cache[0] != self._epoch:
            if self._shuffle:
                generator = torch.Generator()
                generator.manual_seed(self._seed + self._epoch)
                perm = torch.randperm(self._dataset_size, generator=generator)
            else:
                perm = torch.arange(self._dataset_size)
            self._perm_cache = (self._epoch, perm)
        return self._perm_cache[1]

    def _generate_shares(self, token: int) -> Iterator[list[int]]:
        """Batches under uneven shares: each global batch cut in rank order (see :meth:`set_shares`)."""
        shares = self._shares
        assert shares is not None
        seg_start, position = self._seg_start, self._consumed
        total, world, me = sum(shares), self._num_replicas, self._rank
        perm = self._permutation()
        while token == self._token:
            left = self._dataset_size - seg_start - position
            if left <= 0:
                return
            if left >= total:
                split, advance = shares, total
            elif self._drop_last:
                return
            else:
                # the epoch's last global batch, in proportion; fewer samples than ranks: pad
                split = split_shares(max(left, world), [float(s) for s in shares])
                advance = left
            first = seg_start + position + sum(split[:me])
            stream = first + torch.arange(split[me])
            batch = perm[stream % self._dataset_size].tolist()
            position += advance
            self._pending.append((split[me], advance))
            yield batch

    def _generate(self, token: int) -> Iterator[list[int]]:
        if self._shares is not None:
            yield from self._generate_shares(token)
            return
        seg_start, position = self._seg_start, self._consumed
        length = self._local_length(seg_start)
        stream = seg_start + torch.arange(length) * self._num_replicas + self._rank
        # Positions past the dataset are the pads: they wrap to the start of the permutation.
        local = self._permutation()[stream % self._dataset_size].tolist()
        while token == self._token:
            size = min(self._batch_size, length - position)
            if size <= 0 or (self._drop_last and size < self._batch_size):
                return
            batch = local[position : position + size]
            position += size
            self._pending.append((size, size))
            yield batch


class ElasticLoader:
    """A ``DataLoader`` over an :class:`ElasticBatchSampler` that tracks what training consumed.

    Each batch counts as consumed when this loader hands it to the training loop, so a
    :meth:`state_dict` taken after the step on batch ``k`` resumes at batch ``k + 1`` however many
    batches the workers had prefetched. :meth:`set_batch_size` takes effect at the next batch: if
    batches of the old size were prefetched, they are discarded and the ``DataLoader`` iteration
    restarts at the consumed position (with ``persistent_workers=True`` the workers are reused;
    otherwise they are restarted, which costs a worker start-up per change).

    Use one iteration at a time; the usual loop resumes mid-epoch after :meth:`load_state_dict`::

        for epoch in range(start_epoch, epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                ...  # step; checkpoint loader.state_dict() with the model

    Args:
        dataset: A map-style dataset with ``len(dataset) == sampler.dataset_size``.
        sampler: The batch sampler; it owns batch size, shuffling, sharding and ``drop_last``.
        **dataloader_kwargs: Passed to ``DataLoader`` (``num_workers``, ``collate_fn``,
            ``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ...).

    Raises:
        TypeError: ``sampler`` is not an :class:`ElasticBatchSampler`.
        ValueError: A ``DataLoader`` argument the sampler owns is passed (``batch_size``,
            ``shuffle``, ``sampler``, ``batch_sampler``, ``drop_last``), ``in_order=False`` is
            passed (it breaks consumption order), or the dataset length does not match.
    """

    _SAMPLER_OWNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")

    def __init__(self, dataset: Any, sampler: ElasticBatchSampler, **dataloader_kwargs: Any) -> None:
        if not isinstance(sampler, ElasticBatchSampler):
            raise TypeError(f"sampler must be an ElasticBatchSampler, got {type(sampler).__name__}")
        owned = [key for key in self._SAMPLER_OWNED if key in dataloader_kwargs]
        if owned:
            raise ValueError(
                f"{', '.join(owned)} belong(s) to the ElasticBatchSampler; set them there, "
                "not on the loader"
            )
        if dataloader_kwargs.get("in_order", True) is False:
            raise ValueError(
                "in_order=False lets batches arrive out of order, so consumption could not be "
                "tracked; leave in_order at its default (True)"
            )
        if hasattr(dataset, "__len__") and len(dataset) != sampler.dataset_size:
            raise ValueError(
                f"len(dataset) is {len(dataset)} but the sampler has dataset_size "
                f"{sampler.dataset_size}; build the sampler with dataset_size=len(dataset)"
            )
        self._sampler = sampler
        self._loader = DataLoader(dataset, batch_sampler=sampler, **dataloader_kwargs)
        self._restart = False
        self._relayout = False  # the sampler's layout moved: the live iteration stopped, start a new one

    @property
    def sampler(self) -> ElasticBatchSampler:
        return self._sampler

    def __len__(self) -> int:
        """Batches the next iteration yields at the current batch size (see the sampler)."""
        return len(self._sampler)

    def set_epoch(self, epoch: int) -> None:
        """See :meth:`ElasticBatchSampler.set_epoch`."""
        self._sampler.set_epoch(epoch)

    def set_batch_size(self, batch_size: int) -> None:
        """Use ``batch_size`` from the next batch the training loop receives.

        Raises:
            ValueError: ``batch_size`` is not a positive int.
        """
        if batch_size != self._sampler.batch_size:
            self._sampler.set_batch_size(batch_size)
            self._restart = True

    def set_shares(self, shares: list[int] | tuple[int, ...] | None) -> None:
        """Deal uneven shares from the next batch on (see :meth:`ElasticBatchSampler.set_shares`); a no-op when unchanged.

        After each step of an engine built with ``shares=``: ``loader.set_shares(engine.shares)``.

        Raises:
            ValueError: not one positive int per replica.
        """
        if (None if shares is None else tuple(shares)) != self._sampler.shares:
            self._sampler.set_shares(shares)
            self._restart = self._relayout = True

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`ElasticBatchSampler.state_dict`."""
        return self._sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """See :meth:`ElasticBatchSampler.load_state_dict`."""
        self._sampler.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        sampler = self._sampler
        self._restart = False
        iterator: Iterator[Any] | None = iter(self._loader)
        while True:
            if self._restart:
                self._restart = False
                relayout, self._relayout = self._relayout, False
                if relayout:
                    if sampler.exhausted:
                        return
                    iterator = None
                    iterator = iter(self._loader)
                elif sampler.pending_batches:
                    if sampler.exhausted:
                        # Re-iterating would start the epoch over; the smaller tail is dropped.
                        return
                    logger.debug(
                        "batch size now %d: discarding %d prefetched batch(es), restarting at "
                        "sample %d",
                        sampler.batch_size,
                        sampler.pending_batches,
                        sampler.consumed_samples,
                    )
                    # Release the old iterator (and its workers) before starting new ones.
                    iterator = None
                    iterator = iter(self._loader)
            assert iterator is not None
            try:
                batch = next(iterator)
            except StopIteration:
                return
            sampler.mark_consumed()
            yield batch
