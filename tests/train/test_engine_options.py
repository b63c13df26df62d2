"""The engine embeds the finder's options: EngineConfig.find, one target and one capacity, no silent winner."""

from __future__ import annotations

import pytest

import batchpilot.train.engine as engine_module
from batchpilot.find.finder import find_batch_size
from batchpilot.find.options import FindOptions
from batchpilot.memory.probes import emulate_capacity
from batchpilot.memory.units import parse_bytes
from batchpilot.train.engine import Engine, EngineConfig

from engine_utils import CE, batches, make

CAPACITY = parse_bytes("1MiB")


@pytest.fixture
def searches(monkeypatch):
    """The options of every search the engine runs; the real finder runs each."""
    seen = []

    def recording(step, **kw):
        seen.append(kw["options"])
        return find_batch_size(step, **kw)

    monkeypatch.setattr(engine_module, "find_batch_size", recording)
    return seen


def _first_step(engine, model, opt, size=64):
    with emulate_capacity(CAPACITY, track=(model, opt)):
        return engine.step(next(batches(model, size, 1)))


def test_the_engine_target_is_the_finder_target(searches):
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=64, target=0.7)
    _first_step(eng, model, opt)
    assert eng.target == 0.7 and eng.plan.target == 0.7 and searches[0].target == 0.7


def test_the_finder_target_alone_is_the_engine_target(searches):
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=64, config=EngineConfig(find=FindOptions(target=0.6)))
    _first_step(eng, model, opt)
    assert eng.target == 0.6 and eng.plan.target == 0.6


def test_without_either_the_target_is_the_options_default():
    model, opt = make("mlp")
    assert Engine(model, opt, CE, global_batch_size=64).target == FindOptions().target


def test_two_different_targets_are_refused():
    model, opt = make("mlp")
    with pytest.raises(ValueError, match=r"target=0.7 and config.find.target=0.6 disagree: give the target once"):
        Engine(model, opt, CE, global_batch_size=64, target=0.7, config=EngineConfig(find=FindOptions(target=0.6)))
    # the same value twice is one target
    same = Engine(model, opt, CE, global_batch_size=64, target=0.6, config=EngineConfig(find=FindOptions(target=0.6)))
    assert same.target == 0.6


def test_a_shared_config_serves_engines_of_different_targets():
    model, opt = make("mlp")
    cfg = EngineConfig(grow_after=5)
    assert [Engine(model, opt, CE, global_batch_size=64, target=t, config=cfg).target for t in (0.5, 0.7)] == [0.5, 0.7]
    assert cfg.find == FindOptions()  # the engine does not write its target into the caller's options


def test_the_capacity_is_given_once():
    with pytest.raises(ValueError, match=r"capacity=1048576 and find.capacity=2097152 disagree: give the capacity once"):
        EngineConfig(capacity="1MiB", find=FindOptions(capacity="2MiB"))
    cfg = EngineConfig(capacity="1MiB")
    assert cfg.capacity == cfg.find.capacity == CAPACITY
    assert EngineConfig(capacity="1MiB", find=FindOptions(capacity=CAPACITY)).find.capacity == CAPACITY
    # find.capacity alone sizes the search only: the engine keeps reading the device
    alone = EngineConfig(find=FindOptions(capacity="1MiB"))
    assert alone.capacity is None and alone.find.capacity == CAPACITY


def test_find_must_be_the_options_dataclass():
    with pytest.raises(TypeError, match=r"find must be a batchpilot.FindOptions, got dict: "
                                        r"EngineConfig\(find=FindOptions\(max_trials=9\)\)"):
        EngineConfig(find={"max_trials": 9})
    with pytest.raises(TypeError, match="find_options"):
        EngineConfig(find_options={"max_trials": 9})


@pytest.mark.parametrize(("split", "given", "timed"), [("time", None, 3), ("time", 1, 1), ("fewest", None, None)])
def test_a_split_by_time_times_three_steps_unless_told(searches, split, given, timed):
    model, opt = make("mlp")
    cfg = EngineConfig(split=split, find=FindOptions(timed_steps=given))
    _first_step(Engine(model, opt, CE, global_batch_size=64, config=cfg), model, opt)
    assert searches[0].timed_steps == timed


def test_the_options_bound_the_search_within_the_batch(searches):
    model, opt = make("mlp")
    cfg = EngineConfig(find=FindOptions(max_batch_size=4, max_trials=6, strategy="binsearch"))
    eng = Engine(model, opt, CE, global_batch_size=64, config=cfg)
    r = _first_step(eng, model, opt)
    assert max(t.batch_size for t in eng.plan.trials) <= 4 and r.micro_batch_size <= 4
    assert (searches[0].max_trials, searches[0].strategy, searches[0].max_batch_size) == (6, "binsearch", 4)
    # without a bound of its own, the search stops at the batch the engine holds
    model, opt = make("mlp")
    _first_step(Engine(model, opt, CE, global_batch_size=16), model, opt, size=16)
    assert searches[1].max_batch_size == 16
