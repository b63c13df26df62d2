"""Tests for batchpilot.train.data: the elastic batch sampler and the consumption-tracking loader."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from batchpilot.train.data import ElasticBatchSampler, ElasticLoader


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Defaults read these; a test run under torchrun or SLURM must not leak in.
    for var in ("WORLD_SIZE", "SLURM_NTASKS", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _distributed_order(n: int, replicas: int, rank: int, *, seed: int, epoch: int,
                       shuffle: bool = True, drop_last: bool = False) -> list[int]:  # fmt: skip
    """What torch's DistributedSampler gives this rank: the layout the sampler promises."""
    sampler = DistributedSampler(
        _dataset(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    sampler.set_epoch(epoch)
    return list(sampler)


def _consume(sampler: ElasticBatchSampler, num_batches: int | None = None) -> list[list[int]]:
    """Iterate without prefetching, marking each batch consumed as a training loop would."""
    batches = []
    for batch in sampler:
        sampler.mark_consumed()
        batches.append(batch)
        if num_batches is not None and len(batches) == num_batches:
            break
    return batches


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


# -- construction -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(dataset_size=0, batch_size=4), "dataset_size must be >= 1, got 0; pass len(dataset)"),
        (dict(dataset_size=10, batch_size=0), "batch_size must be >= 1, got 0"),
        (dict(dataset_size=10, batch_size=-2), "batch_size must be >= 1"),
        (dict(dataset_size=10, batch_size=True), "batch_size must be an int"),
        (dict(dataset_size=10.0, batch_size=2), "dataset_size must be an int"),
        (dict(dataset_size=10, batch_size=2, num_replicas=2, rank=2), "rank 2 is out of range for num_replicas 2; use a rank in 0..1"),
        (dict(dataset_size=10, batch_size=2, num_replicas=2, rank=-1), "rank must be >= 0, got -1; ranks count from 0"),
        (dict(dataset_size=10, batch_size=2, num_replicas=0, rank=0), "num_replicas must be >= 1"),
        (dict(dataset_size=10, batch_size=2, seed=2**64), "seed must be < 2**63"),
        (dict(dataset_size=10, batch_size=2, seed="0"), "seed must be an int"),
    ],
)  # fmt: skip
def test_bad_arguments(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        ElasticBatchSampler(**kwargs)
    assert fragment in str(excinfo.value)


def test_replicas_and_rank_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = ElasticBatchSampler(10, 2)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    sampler = ElasticBatchSampler(10, 2)
    assert (sampler.num_replicas, sampler.rank) == (4, 3)
    monkeypatch.delenv("RANK")
    # Several replicas but no rank: refusing beats every process silently being rank 0.
    with pytest.raises(ValueError, match="no rank is known.*pass rank= explicitly"):
        ElasticBatchSampler(10, 2)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        ElasticBatchSampler(10, 2)


def test_replicas_and_rank_from_process_group(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sampler = ElasticBatchSampler(10, 2)
        assert (sampler.num_replicas, sampler.rank) == (1, 0)
    finally:
        dist.destroy_process_group()


# -- layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 20, 33])
@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_layout_matches_distributed_sampler(n: int, replicas: int, shuffle: bool, drop_last: bool) -> None:
    batch_size = 4
    for rank in range(replicas):
        sampler = ElasticBatchSampler(n, batch_size, shuffle=shuffle, seed=5, drop_last=drop_last,
                                      num_replicas=replicas, rank=rank)  # fmt: skip
        sampler.set_epoch(2)
        batches = _consume(sampler)
        expected = _distributed_order(n, replicas, rank, seed=5, epoch=2, shuffle=shuffle,
                                      drop_last=drop_last)  # fmt: skip
        if drop_last:
            # drop_last also drops each rank's final partial batch.
            expected = expected[: len(expected) // batch_size * batch_size]
            assert all(len(b) == batch_size for b in batches)
        assert _flat(batches) == expected
        assert len(batches) == -(-len(expected) // batch_size)


def test_padding_repeats_the_start_of_the_permutation() -> None:
    # 10 samples on 4 ranks: 2 pads, which are the first two samples of the permutation.
    order = [_flat(_consume(ElasticBatchSampler(10, 3, seed=1, num_replicas=4, rank=r)))
             for r in range(4)]  # fmt: skip
    stream = [order[p % 4][p // 4] for p in range(12)]
    assert sorted(stream[:10]) == list(range(10))
    assert stream[10:] == stream[:2]


def test_epochs_reshuffle_deterministically() -> None:
    def epoch_order(epoch: int, seed: int = 0) -> list[int]:
        sampler = ElasticBatchSampler(50, 8, seed=seed)
        sampler.set_epoch(epoch)
        return _flat(_consume(sampler))

    assert epoch_order(0) == epoch_order(0)
    assert epoch_order(0) != epoch_order(1)
    assert epoch_order(0, seed=1) != epoch_order(0)
    assert sorted(epoch_order(3)) == list(range(50))
    assert _flat(_consume(ElasticBatchSampler(9, 4, shuffle=False))) == list(range(9))


def test_set_epoch_same_epoch_keeps_the_cursor_other_epoch_resets() -> None:
    sampler = ElasticBatchSampler(20, 4, seed=0)
    first = _consume(sampler, 2)
    sampler.set_epoch(0)  # no-op: we are in epoch 0
    rest = _consume(sampler)
    assert sorted(_flat(first + rest)) == list(range(20))
    _consume(sampler, 1)
    sampler.set_epoch(1)
    assert sorted(_flat(_consume(sampler))) == list(range(20))
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        sampler.set_epoch(-1)


def test_a_finished_epoch_starts_over_in_the_same_order() -> None:
    # As DistributedSampler: without set_epoch, the next pass repeats the epoch.
    sampler = ElasticBatchSampler(13, 4, seed=2)
    first = _consume(sampler)
    assert sampler.exhausted
    assert len(sampler) == 4
    assert _consume(sampler) == first


def test_len_counts_batches_of_the_next_iteration() -> None:
    sampler = ElasticBatchSampler(21, 4, num_replicas=2, rank=0)  # 11 samples on this rank
    assert len(sampler) == 3
    _consume(sampler, 1)
    sampler.set_batch_size(2)
    assert len(sampler) == 4  # 7 samples left on this rank
    loader = DataLoader(_dataset(21), batch_sampler=sampler)
    assert len(loader) == 4
    dropping = ElasticBatchSampler(21, 4, drop_last=True, num_replicas=2, rank=0)  # 10 per rank
    assert len(dropping) == 2


# -- batch size changes and consumption ---------------------------------------------------------


def test_batch_size_change_applies_to_batches_not_yet_generated() -> None:
    sampler = ElasticBatchSampler(30, 4, seed=3)
    iterator = iter(sampler)
    generated = [next(iterator), next(iterator)]  # prefetched at size 4
    sampler.set_batch_size(6)
    generated += list(iterator)
    assert [len(b) for b in generated] == [4, 4, 6, 6, 6, 4]
    assert sorted(_flat(generated)) == list(range(30))


def test_state_counts_consumed_not_generated_batches() -> None:
    sampler = ElasticBatchSampler(40, 4, seed=3, num_replicas=2, rank=1)
    iterator = iter(sampler)
    batches = [next(iterator) for _ in range(4)]  # a DataLoader's prefetch
    assert sampler.pending_batches == 4
    assert sampler.mark_consumed() == 4
    sampler.set_batch_size(3)
    batches.append(next(iterator))  # generated at size 3
    assert sampler.mark_consumed(2) == 8
    state = sampler.state_dict()
    # Three batches of 4 consumed on each of 2 ranks; the size-3 batch is still pending.
    assert state["consumed"] == 24 and sampler.consumed_samples == 24
    assert sampler.pending_batches == 2

    resumed = ElasticBatchSampler(40, 1, seed=3, num_replicas=2, rank=1)
    resumed.load_state_dict(state)
    assert resumed.batch_size == 3
    expected_rest = _distributed_order(40, 2, 1, seed=3, epoch=0)[12:]
    assert _flat(_consume(resumed)) == expected_rest


def test_mark_consumed_rejects_more_than_was_handed_out() -> None:
    sampler = ElasticBatchSampler(10, 2)
    with pytest.raises(ValueError, match=r"only 0 batch\(es\) were handed out"):
        sampler.mark_consumed()
    iterator = iter(sampler)
    next(iterator)
    with pytest.raises(ValueError, match=r"mark_consumed\(2\) but only 1"):
        sampler.mark_consumed(2)
    with pytest.raises(ValueError, match="num_batches must be >= 1"):
        sampler.mark_consumed(0)


def test_new_iteration_serves_unconsumed_batches_again() -> None:
    sampler = ElasticBatchSampler(12, 3, seed=4)
    iterator = iter(sampler)
    first = next(iterator)
    sampler.mark_consumed()
    abandoned = [next(iterator), next(iterator)]  # generated, never consumed
    again = _consume(sampler)
    assert again[:2] == abandoned
    assert sorted(first + _flat(again)) == list(range(12))
    with pytest.raises(StopIteration):
        next(iterator)  # the abandoned iteration stopped


@pytest.mark.parametrize("bad", [0, -3, True, 2.0])
def test_set_batch_size_rejects(bad) -> None:
    sampler = ElasticBatchSampler(10, 2)
    with pytest.raises(ValueError, match="batch_size must be"):
        sampler.set_batch_size(bad)
    assert sampler.batch_size == 2


def test_drop_last_drops_the_rank_tail_and_partial_batches() -> None:
    # 23 samples on 2 ranks: 1 dropped so ranks get 11 each; batches of 4: 3 more per rank dropped.
    seen = []
    for rank in range(2):
        batches = _consume(ElasticBatchSampler(23, 4, seed=0, drop_last=True, num_replicas=2, rank=rank))
        assert [len(b) for b in batches] == [4, 4]
        seen += _flat(batches)
    assert len(seen) == len(set(seen)) == 16


# -- checkpoints --------------------------------------------------------------------------------


def test_state_dict_round_trip_and_contents() -> None:
    sampler = ElasticBatchSampler(100, 8, seed=11, num_replicas=4, rank=2, drop_last=True)
    sampler.set_epoch(5)
    _consume(sampler, 3)
    state = sampler.state_dict()
    assert state == {
        "version": 1, "epoch": 5, "consumed": 96, "batch_size": 8, "dataset_size": 100,
        "seed": 11, "shuffle": True, "drop_last": True, "num_replicas": 4, "shares": None,
    }  # fmt: skip
    other = ElasticBatchSampler(100, 2, seed=11, num_replicas=4, rank=2, drop_last=True)
    other.load_state_dict(state)
    assert other.state_dict() == state


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (dict(dataset_size=99), "saved with dataset_size=100 but this sampler has dataset_size=99"),
        (dict(seed=1), "saved with seed=11 but this sampler has seed=1; the epoch permutation would differ"),
        (dict(shuffle=False), "saved with shuffle=True"),
    ],
)
def test_load_state_for_another_dataset_or_seed_fails(change: dict, fragment: str) -> None:
    state = ElasticBatchSampler(100, 8, seed=11).state_dict()
    kwargs = dict(dataset_size=100, batch_size=8, seed=11) | change
    sampler = ElasticBatchSampler(**kwargs)
    with pytest.raises(ValueError) as excinfo:
        sampler.load_state_dict(state)
    assert fragment in str(excinfo.value)
    assert "Construct the sampler with" in str(excinfo.value)


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda s: s.pop("consumed"), "missing consumed"),
        (lambda s: s.update(version=99), "version 99 is not supported"),
        (lambda s: s.update(consumed=-1), "state['consumed'] must be >= 0"),
        (lambda s: s.update(consumed=101), "state['consumed']=101 exceeds dataset_size 100"),
        (lambda s: s.update(batch_size=0), "state['batch_size'] must be >= 1"),
    ],
)
def test_load_malformed_state_fails(edit, fragment: str) -> None:
    state = ElasticBatchSampler(100, 8).state_dict()
    edit(state)
    with pytest.raises(ValueError) as excinfo:
        ElasticBatchSampler(100, 8).load_state_dict(state)
    assert fragment in str(excinfo.value)


def test_resume_at_the_end_of_an_epoch_serves_nothing_then_the_next_epoch() -> None:
    sampler = ElasticBatchSampler(10, 3, seed=0)
    _consume(sampler)  # checkpoint taken in the body of the last step
    state = sampler.state_dict()
    resumed = ElasticBatchSampler(10, 3, seed=0)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the usual loop re-enters the saved epoch ...
    assert len(resumed) == 0
    assert _consume(resumed) == []  # ... which is done
    resumed.set_epoch(1)
    assert _flat(_consume(resumed)) == _distributed_order(10, 1, 0, seed=0, epoch=1)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3), (3, 2), (4, 1)])
@pytest.mark.parametrize("consumed_batches", [0, 1, 2, 4])
def test_resume_on_another_number_of_replicas_serves_every_sample_once(
    before: int, after: int, consumed_batches: int
) -> None:
    n, batch_size = 23, 2
    seen: list[int] = []
    old = [ElasticBatchSampler(n, batch_size, seed=9, num_replicas=before, rank=r) for r in range(before)]
    for sampler in old:
        seen += _flat(_consume(sampler, consumed_batches))
    state = old[0].state_dict()
    assert all(s.state_dict() == state for s in old)  # any rank's state is the job's state
    new = [ElasticBatchSampler(n, 5, seed=9, num_replicas=after, rank=r) for r in range(after)]
    tails = []
    for sampler in new:
        sampler.load_state_dict(state)
        tails.append(_flat(_consume(sampler)))
        seen += tails[-1]
    assert len({len(t) for t in tails}) == 1  # equal shares on the new world
    counts = Counter(seen)
    assert set(counts) == set(range(n))
    # The only repeats are pads at the end of the epoch, fewer than the replicas padding for it.
    pads = len(seen) - n
    assert 0 <= pads < max(before, after)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 4)])
def test_resume_on_another_number_of_replicas_keeps_the_constructed_batch_size(before: int, after: int) -> None:
    # a global batch of 8: the saved batch size (8 // before) is the old world's per-rank share
    global_batch = 8
    old = ElasticBatchSampler(32, global_batch // before, seed=3, num_replicas=before, rank=0)
    _consume(old, 1)
    state = old.state_dict()
    resumed = ElasticBatchSampler(32, global_batch // after, seed=3, num_replicas=after, rank=0)
    resumed.load_state_dict(state)
    assert resumed.batch_size == global_batch // after  # not the saved global_batch // before
    assert resumed.consumed_samples == global_batch
    assert [len(b) for b in _consume(resumed, 2)] == [global_batch // after] * 2
    same = ElasticBatchSampler(32, 1, seed=3, num_replicas=before, rank=0)
    same.load_state_dict(state)
    assert same.batch_size == global_batch // before  # same world: the saved size is restored


# -- property: exactly once under prefetching, batch-size changes, restarts and resumes ---------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("batch_size"), st.integers(1, 7), st.booleans()),
        st.tuples(st.just("resume"), st.integers(1, 3)),
    ),
    max_size=12,
)


class _Job:
    """One sampler per simulated rank, each with a DataLoader-like prefetch buffer."""

    def __init__(self, n: int, batch_size: int, replicas: int, depth: int, drop_last: bool,
                 shuffle: bool, state: dict | None = None, epoch: int = 0) -> None:  # fmt: skip
        self.depth = depth
        self.samplers = [
            ElasticBatchSampler(n, batch_size, seed=17, drop_last=drop_last, shuffle=shuffle,
                                num_replicas=replicas, rank=r)
            for r in range(replicas)
        ]  # fmt: skip
        for sampler in self.samplers:
            if state is not None:
                sampler.load_state_dict(state)
            sampler.set_epoch(epoch)
        self.restart()

    def restart(self) -> None:
        self.iterators = [iter(s) for s in self.samplers]
        self.buffers: list[list[list[int]]] = [[] for _ in self.samplers]

    def step(self) -> list[int] | None:
        """Prefetch up to ``depth`` batches per rank, then consume one batch on every rank."""
        for iterator, buffer in zip(self.iterators, self.buffers):
            while len(buffer) < self.depth:
                batch = next(iterator, None)
                if batch is None:
                    break
                buffer.append(batch)
        if not any(self.buffers):
            return None
        assert all(self.buffers), "ranks out of step: one ran out of batches before another"
        batches = [buffer.pop(0) for buffer in self.buffers]
        assert len({len(b) for b in batches}) == 1, "ranks got different batch sizes"
        for sampler in self.samplers:
            sampler.mark_consumed()
        return [i for b in batches for i in b]


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 40),
    batch_size=st.integers(1, 7),
    replicas=st.integers(1, 3),
    depth=st.integers(1, 4),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    epoch_ops=st.lists(_ops, min_size=2, max_size=2),
)
def test_every_sample_once_per_epoch(n, batch_size, replicas, depth, drop_last, shuffle, epoch_ops) -> None:
    job = _Job(n, batch_size, replicas, depth, drop_last, shuffle)
    for epoch, ops in enumerate(epoch_ops):
        if epoch:
            for sampler in job.samplers:
                sampler.set_epoch(epoch)
            job.restart()
        seen: list[int] = []
        replicas_used, sizes_used = {len(job.samplers)}, {job.samplers[0].batch_size}
        done = False
        for op in ops:
            if op[0] == "step":
                for _ in range(op[1]):
                    batch = job.step()
                    if batch is None:
                        done = True
                        break
                    seen += batch
            elif op[0] == "batch_size":
                for sampler in job.samplers:
                    sampler.set_batch_size(op[1])
                sizes_used.add(op[1])
                # What ElasticLoader does: drop prefetched batches and restart at the cursor.
                if op[2] and not job.samplers[0].exhausted:
                    if job.samplers[0].pending_batches:
                        event("restart with prefetched batches")
                    job.restart()
            else:
                state = job.samplers[0].state_dict()
                if 0 < state["consumed"] < n and op[1] != len(job.samplers):
                    event("resumed mid-epoch on another number of replicas")
                same_world = op[1] == len(job.samplers)
                job = _Job(n, 1, op[1], depth, drop_last, shuffle, state=state, epoch=epoch)
                # the saved batch size is a per-rank share: restored only on as many replicas
                assert job.samplers[0].batch_size == (state["batch_size"] if same_world else 1)
                replicas_used.add(op[1])
            if done:
                break
        while (batch := job.step()) is not None:
            seen += batch
        counts = Counter(seen)
        if drop_last:
            assert max(counts.values(), default=1) == 1, "a sample was repeated"
            max_dropped = max(replicas_used) * max(sizes_used) - 1
            assert n - len(seen) <= max_dropped
        else:
            assert set(counts) == set(range(n)), "a sample was skipped"
            assert len(seen) - n < max(replicas_used), "repeats beyond end-of-epoch padding"


# -- ElasticLoader with a real DataLoader --------------------------------------------------------


def test_loader_rejects_arguments_the_sampler_owns() -> None:
    sampler = ElasticBatchSampler(10, 2)
    with pytest.raises(ValueError, match="batch_size, drop_last belong.*to the ElasticBatchSampler"):
        ElasticLoader(_dataset(10), sampler, batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="in_order=False"):
        ElasticLoader(_dataset(10), sampler, in_order=False)
    with pytest.raises(ValueError, match="len\\(dataset\\) is 11 but the sampler has dataset_size 10"):
        ElasticLoader(_dataset(11), sampler)
    with pytest.raises(TypeError, match="ElasticBatchSampler"):
        ElasticLoader(_dataset(10), DistributedSampler(_dataset(10), num_replicas=1, rank=0))


def _values(batch) -> list[int]:
    (tensor,) = batch
    return tensor.tolist()


LOADER_CONFIGS = [
    pytest.param(dict(num_workers=0), id="workers0"),
    pytest.param(dict(num_workers=2, prefetch_factor=2), id="workers2"),
    pytest.param(dict(num_workers=2, prefetch_factor=2, persistent_workers=True), id="workers2-persistent"),
]


@pytest.mark.parametrize("loader_kwargs", LOADER_CONFIGS)
def test_loader_three_epochs_with_batch_size_changes_and_resumes(loader_kwargs: dict) -> None:
    n, replicas, seed = 29, 2, 7
    dataset = _dataset(n)

    def make(state: dict | None = None) -> list[ElasticLoader]:
        loaders = []
        for rank in range(replicas):
            sampler = ElasticBatchSampler(n, 3, seed=seed, num_replicas=replicas, rank=rank)
            if state is not None:
                sampler.load_state_dict(state)
            loaders.append(ElasticLoader(dataset, sampler, **loader_kwargs))
        return loaders

    # (epoch, steps done) -> action; "resume" checkpoints, then rebuilds samplers and loaders.
    plan = {(0, 2): 5, (0, 3): "resume", (1, 1): 2, (1, 3): 4, (1, 4): "resume", (2, 2): 1,
            (2, 5): "resume", (2, 6): 6}  # fmt: skip
    loaders = make()
    for epoch in range(3):
        for loader in loaders:
            loader.set_epoch(epoch)
        iterators = [iter(loader) for loader in loaders]
        seen: list[list[int]] = [[] for _ in range(replicas)]
        steps = 0
        while True:
            batches = [next(iterator, None) for iterator in iterators]
            if batches[0] is None:
                assert all(b is None for b in batches)
                break
            (size,) = {len(_values(b)) for b in batches}  # the same on every rank
            batch_size = loaders[0].sampler.batch_size
            # The new size applies from the next batch; only the epoch's last batch is smaller.
            assert size == batch_size or (size < batch_size and loaders[0].sampler.exhausted)
            for rank, batch in enumerate(batches):
                seen[rank] += _values(batch)
            steps += 1
            action = plan.get((epoch, steps))
            if action == "resume":
                state = loaders[0].state_dict()
                assert state["consumed"] == replicas * len(seen[0]), "consumed != what training got"
                loaders = make(state)
                for loader in loaders:
                    loader.set_epoch(epoch)
                iterators = [iter(loader) for loader in loaders]
            elif action is not None:
                for loader in loaders:
                    loader.set_batch_size(action)
        for rank in range(replicas):
            assert seen[rank] == _distributed_order(n, replicas, rank, seed=seed, epoch=epoch)
        counts = Counter(seen[0] + seen[1])
        assert set(counts) == set(range(n))
        assert sum(counts.values()) == n + 1  # 29 on 2 ranks: one pad, a repeat of the first sample


def test_loader_checkpoint_under_prefetch_resumes_after_the_last_consumed_batch() -> None:
    n = 40
    dataset = _dataset(n)
    loader = ElasticLoader(dataset, ElasticBatchSampler(n, 4, seed=1), num_workers=2, prefetch_factor=2)
    got = []
    for step, batch in enumerate(loader):
        got += _values(batch)
        if step == 2:
            state = loader.state_dict()
            # Workers had asked for more batches than training used.
            assert loader.sampler.pending_batches > 0
            break
    assert state["consumed"] == 12
    resumed = ElasticLoader(dataset, ElasticBatchSampler(n, 4, seed=1))
    resumed.load_state_dict(state)
    got += [i for batch in resumed for i in _values(batch)]
    assert got == _distributed_order(n, 1, 0, seed=1, epoch=0)


def test_loader_batch_size_change_on_the_last_batch_ends_the_epoch() -> None:
    n = 20
    loader = ElasticLoader(
        _dataset(n), ElasticBatchSampler(n, 3, seed=0, drop_last=True), num_workers=2, prefetch_factor=2
    )
    got = []
    for step, batch in enumerate(loader):
        got += _values(batch)
        if step == 4:  # 15 of 20 consumed; 3 more fit at size 3, none at size 8
            assert loader.sampler.pending_batches > 0
            loader.set_batch_size(8)
    assert len(got) == len(set(got)) == 15


# -- uneven shares --------------------------------------------------------------------------------


def _lockstep(samplers: list[ElasticBatchSampler], steps: int | None = None, change: dict | None = None) -> list[int]:
    """Every rank takes one batch per step, as engine steps do; ``change[step]``: shares set on every rank first."""
    seen: list[int] = []
    iterators = [iter(s) for s in samplers]
    step = 0
    while steps is None or step < steps:
        if change and step in change:
            for s in samplers:
                s.set_shares(change[step])
            iterators = [iter(s) for s in samplers]
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            break
        assert all(b is not None for b in batches), "ranks ran out of batches at different steps"
        for s, b in zip(samplers, batches):
            s.mark_consumed()
            seen.extend(b)
        step += 1
    return seen


def test_shares_cut_each_global_batch_in_rank_order_and_the_tail_in_proportion():
    samplers = [ElasticBatchSampler(50, 4, shuffle=False, num_replicas=2, rank=r, shares=[12, 4]) for r in (0, 1)]
    first = [next(iter(s)) for s in samplers]
    assert first == [list(range(12)), list(range(12, 16))]
    assert [len(s) for s in samplers] == [4, 4]  # 3 global batches of 16 and a tail of 2
    seen = _lockstep(samplers)
    assert sorted(seen) == list(range(50))
    assert samplers[0].state_dict()["consumed"] == 50 and samplers[0].state_dict()["shares"] == [12, 4]
    # drop_last drops the short global batch
    dropped = [ElasticBatchSampler(50, 4, num_replicas=2, rank=r, shares=[12, 4], drop_last=True) for r in (0, 1)]
    assert len(_lockstep(dropped)) == 48


def test_fewer_samples_than_ranks_at_the_end_pad_as_distributed_sampler_does():
    samplers = [ElasticBatchSampler(33, 4, shuffle=False, num_replicas=3, rank=r, shares=[8, 4, 4]) for r in range(3)]
    seen = _lockstep(samplers)
    assert Counter(seen) == Counter(list(range(33)) + [0, 1])  # the tail of 1 padded to one sample per rank


@pytest.mark.parametrize("world", [2, 3])
def test_changing_shares_mid_epoch_serves_every_sample_once(world):
    """Equal batches first, then shares, then other shares, as an engine's rebalances go."""
    samplers = [ElasticBatchSampler(101, 5, seed=4, num_replicas=world, rank=r) for r in range(world)]
    a = [7] * (world - 1) + [2]
    b = [1] + [9] * (world - 1)
    seen = _lockstep(samplers, change={3: a, 6: b, 8: None})
    assert sorted(seen) == list(range(101))


def test_a_mid_epoch_state_with_shares_resumes_on_another_world_and_split():
    samplers = [ElasticBatchSampler(97, 8, seed=2, num_replicas=2, rank=r, shares=[11, 5]) for r in (0, 1)]
    before = _lockstep(samplers, steps=3)
    state = samplers[1].state_dict()
    assert state["consumed"] == 48
    for world, shares in ((1, None), (3, [1, 2, 3]), (2, [5, 11])):
        resumed = [ElasticBatchSampler(97, 8, seed=2, num_replicas=world, rank=r, shares=shares) for r in range(world)]
        for s in resumed:
            s.load_state_dict(state)
        got = before + _lockstep(resumed)
        # every sample once, and at most world - 1 pads (a tail shorter than the ranks)
        assert set(got) == set(range(97)) and len(got) - 97 < world, (world, shares)


def test_the_loader_follows_new_shares_from_the_next_batch():
    data = TensorDataset(torch.arange(40))
    loaders = [ElasticLoader(data, ElasticBatchSampler(40, 4, seed=1, num_replicas=2, rank=r)) for r in (0, 1)]
    seen, sizes = [], []
    for batches in zip(*loaders):
        sizes.append([len(b[0]) for b in batches])
        seen.extend(i for b in batches for i in b[0].tolist())
        for loader in loaders:
            loader.set_shares([6, 2])
    assert sizes[0] == [4, 4] and sizes[1] == [6, 2]
    assert sorted(seen) == list(range(40))
    with pytest.raises(ValueError, match=r"one positive int per replica \(2\).*engine.shares"):
        loaders[0].set_shares([8])
