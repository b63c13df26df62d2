"""The engine's batch sizes over a world of ranks, and its one agreement per step.

``global_batch_size`` is the batch over all ranks; each rank steps on ``global // world``. A
coordinator that reports a world size but agrees locally stands in for the ranks here (no
process group): the arithmetic, the errors, the checkpoints and the calls the engine makes
are the same as under torchrun (tests/dist/test_distributed.py runs the real thing).
"""

from __future__ import annotations

import logging

import pytest

from batchpilot.memory.probes import emulate_capacity
from batchpilot.train.batching import BatchConfig
from batchpilot.train.engine import Coordinator, Engine, EngineConfig, LocalCoordinator

from engine_utils import CE, GLOBAL, InjectOOM, assert_params_close, batches, make, one_thread, params  # noqa: F401

N = GLOBAL["mlp"]


class World(LocalCoordinator):
    """``world_size`` ranks that all agree with this one; counts the agreements."""

    def __init__(self, world_size: int = 1, remote_oom_at: set[int] = frozenset()) -> None:
        self.world_size = world_size
        self.remote_oom_at = set(remote_oom_at)  # agree() calls (0-based) where "another rank" ran out
        self.calls: list[tuple] = []

    def agree_oom(self, oom: bool) -> bool:
        self.calls.append(("agree_oom", oom))
        return oom

    def agree_micro_batch(self, size: int) -> int:
        self.calls.append(("agree_micro_batch", size))
        return size

    def agree(self, oom: bool, size: int) -> tuple[bool, int]:
        index = sum(c[0] == "agree" for c in self.calls)
        self.calls.append(("agree", oom, size))
        if oom or index in self.remote_oom_at:
            return True, size
        return False, size


# -- global = micro × world × accum --------------------------------------------------------------


def test_global_batch_is_shared_over_the_world():
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=N, micro_batch_size=N // 8, coordinator=World(2))
    assert (eng.global_batch_size, eng.world_size, eng.per_rank_batch_size) == (N, 2, N // 2)
    r = eng.step(next(batches(model, N // 2, 1)))
    assert (r.samples, r.micro_batch_size, r.accum_steps) == (N // 2, N // 8, 4)
    assert eng.batch_config == BatchConfig(global_batch_size=N, micro_batch_size=N // 8, world_size=2)
    assert eng.batch_config.accum_steps == eng.accum_steps == 4
    assert eng.describe() == f"global {N} = micro {N // 8} × world 2 × accum 4"
    with pytest.raises(ValueError, match=rf"the batch has {N} samples, more than this rank's share {N // 2} "
                                         rf"\(global_batch_size={N} over 2 ranks\)"):
        eng.step(next(batches(model, N, 1)))


def test_a_rank_trains_on_its_share_as_one_process_would():
    # this rank's update is the one-process update on the same samples (DDP then averages ranks)
    data = list(batches(make("mlp")[0], N // 2, 3))
    model, opt = make("mlp")
    for b in data:
        Engine(model, opt, CE, global_batch_size=N // 2, micro_batch_size=N // 8).step(b)
    ref = params(model)
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=N, micro_batch_size=N // 8, coordinator=World(2))
    for b in data:
        eng.step(b)
    assert_params_close(params(model), ref)


def test_a_world_of_one_takes_the_whole_global_batch():
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=N, micro_batch_size=N // 4)
    assert (eng.world_size, eng.per_rank_batch_size) == (1, N)
    assert eng.step(next(batches(model, N, 1))).samples == N
    assert eng.describe() == f"global {N} = micro {N // 4} × world 1 × accum 4"


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(global_batch_size=65), "global_batch_size=65 is not divisible by world_size 2; nearest valid "
                                 "global_batch_size: 64 or 66"),
    (dict(global_batch_size=64, micro_batch_size=40), r"micro_batch_size=40 is larger than this rank's share 32 "
                                                      r"\(global_batch_size=64 over 2 ranks\); use at most 32"),
    (dict(global_batch_size=64, start=33), r"start=33 is larger than this rank's share 32"),
])
def test_batch_sizes_that_do_not_split_over_the_world(kwargs, match):
    model, opt = make("mlp")
    with pytest.raises(ValueError, match=match):
        Engine(model, opt, CE, coordinator=World(2), **kwargs)


def test_a_smaller_last_micro_batch_is_described_not_forced_into_a_batch_config():
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=20, start=4, coordinator=World(2))
    assert eng.batch_config is None
    assert eng.describe() == "global 20 = world 2 × 10 per rank, micro-batch not chosen yet"
    r = eng.step(next(batches(model, 10, 1)))
    # 10 per rank at a micro-batch of 4 is 4 + 3 + 3 (balanced): BatchConfig (exact division) cannot say it
    assert (r.micro_batch_size, r.accum_steps) == (4, 3)
    assert eng.batch_config is None
    assert eng.describe() == ("global 20 = world 2 × 10 per rank, micro 4 × accum 3 (1 of 4, 2 of 3): "
                              "fewest micro-batches of at most 4, balanced (not timed)")
    fixed = Engine(model, opt, CE, global_batch_size=20, micro_batch_size=4, coordinator=World(2))
    fixed.step(next(batches(model, 10, 1)))  # a fixed micro-batch is cut as the user's loop would: 4 + 4 + 2
    assert fixed.describe() == "global 20 = world 2 × 10 per rank, micro 4 × accum 3 (last micro-batch 2)"


# -- checkpoints across world sizes -----------------------------------------------------------------


def test_state_keeps_the_global_batch_across_world_sizes(caplog):
    model, opt = make("mlp")
    two = Engine(model, opt, CE, global_batch_size=N, start=N // 2, coordinator=World(2))
    two.step(next(batches(model, N // 2, 1)))
    state = two.state_dict()
    assert (state["global_batch"]["global_batch_size"], state["global_batch"]["world_size"],
            state["micro_batch"]["policy"]["micro"]) == (N, 2, N // 2)

    one = Engine(model, opt, CE, global_batch_size=N)  # the same global batch on one rank
    with caplog.at_level(logging.INFO, logger="batchpilot.train.engine"):
        one.load_state_dict(state)
    assert (one.per_rank_batch_size, one.micro_batch_size, one.accum_steps) == (N, N // 2, 2)
    assert "saved on 2 rank(s), resumed on 1" in caplog.text
    r = one.step(next(batches(model, N, 1)))
    assert (r.samples, r.micro_batch_size, r.accum_steps) == (N, N // 2, 2)

    # and back: the one-rank micro-batch of N is clamped to the per-rank batch of N / 4
    one_big = Engine(model, opt, CE, global_batch_size=N, start=N)
    one_big.step(next(batches(model, N, 1)))
    four = Engine(model, opt, CE, global_batch_size=N, coordinator=World(4))
    four.load_state_dict(one_big.state_dict())
    assert (four.per_rank_batch_size, four.micro_batch_size, four.accum_steps) == (N // 4, N // 4, 1)


def test_state_for_another_global_batch_warns_and_version_one_loads(caplog):
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=N, start=8)
    eng.step(next(batches(model, N, 1)))
    state = eng.state_dict()
    other = Engine(model, opt, CE, global_batch_size=N // 2)
    with caplog.at_level(logging.WARNING, logger="batchpilot.train.engine"):
        other.load_state_dict(state)
    assert f"saved for a global batch of {N}; this engine trains on {N // 2}" in caplog.text
    # version 1 stored the per-rank batch as global_batch_size and no world size
    flat = {**{k: v for k, v in state.items() if k not in ("global_batch", "micro_batch")},
            **state["global_batch"], **state["micro_batch"]}  # versions 1-3 were one flat dict
    old = {k: v for k, v in flat.items() if k != "world_size"} | {"version": 1, "global_batch_size": N // 2}
    resumed = Engine(model, opt, CE, global_batch_size=N, coordinator=World(2))
    resumed.load_state_dict(old)
    assert resumed.micro_batch_size == 8 and resumed.steps == 1


# -- one agreement per step ---------------------------------------------------------------------


def test_an_auto_step_agrees_once_a_fixed_step_votes_once():
    model, opt = make("mlp")
    coord = World()
    assert isinstance(coord, Coordinator)
    eng = Engine(model, opt, InjectOOM(CE, at={1}), global_batch_size=N, start=N // 2, coordinator=coord)
    for b in batches(model, N, 3):
        eng.step(b)
    # first micro-batch; attempt 1 OOMs (call 1), the retry at N/4, then one agreement per step
    assert coord.calls == [
        ("agree_micro_batch", N // 2),
        ("agree", True, N // 2), ("agree_micro_batch", N // 4), ("agree", False, N // 4),
        ("agree", False, N // 4),
        ("agree", False, N // 4),
    ]
    model, opt = make("mlp")
    coord = World()
    eng = Engine(model, opt, CE, global_batch_size=N, micro_batch_size=N // 2, coordinator=coord)
    for b in batches(model, N, 2):
        eng.step(b)
    assert coord.calls == [("agree_oom", False), ("agree_oom", False)]


def test_a_remote_oom_undoes_this_rank_s_growth_decision():
    # this rank's attempt succeeded and its policy decided to grow; another rank ran out of
    # memory in the same attempt: the retry shrinks from the state before the decision
    model, opt = make("mlp")
    coord = World(remote_oom_at={1})
    eng = Engine(model, opt, CE, global_batch_size=N, start=N // 2, coordinator=coord,
                 config=EngineConfig(grow_after=1, capacity=2**30))
    with emulate_capacity(2**30, track=(model, opt)):
        first = eng.step(next(batches(model, N, 1, seed=1)))
        assert first.next_micro_batch_size == N  # one clean step was enough to grow
        second = eng.step(next(batches(model, N, 1, seed=2)))
    # the grown size N was on probation when "another rank" ran out. Undone, the OOM hits the
    # probation: back to N / 2 and the wait doubles (the growth failed), as when the OOM vote came
    # before the decision. Kept, the local clean attempt would have confirmed the growth, and
    # the OOM would halve without backing off.
    proposals = [c for c in coord.calls if c[0] == "agree"]
    assert proposals[1][2] == N  # the discarded proposal (the probation's next size)
    assert second.ooms == 1 and second.micro_batch_size == N // 2
    assert eng.policy.wait == 2  # the failed growth backed off
