"""The finder's flags are built from FindOptions: the same names, the fields' own help, the options they set."""

from __future__ import annotations

import dataclasses

from batchpilot.app.cli import build_parser
import argparse

import pytest

from batchpilot.app.cli.common import FIND_FLAGS, find_options_of, shape
from batchpilot.find.options import FindOptions, option_help
from batchpilot.memory.units import parse_bytes

#: options without a flag, as FIND_FLAGS' comment says (first_guess: --plan-first seeds it)
UNFLAGGED = {"first_guess", "max_trials", "tolerance", "snapshot"}
#: the flag names users rely on (docs/cli.md): a contract
FLAGS = {"target": "--target", "capacity": "--capacity", "strategy": "--strategy", "min_batch_size": "--min-batch-size",
         "max_batch_size": "--max-batch-size", "steps_per_trial": "--steps-per-trial", "progress": "--no-progress",
         "objective": "--objective", "speed_tolerance": "--speed-tolerance", "timed_steps": "--timed-steps"}


def _command(name: str):
    parser = build_parser()
    return parser._subparsers._group_actions[0].choices[name]


def _actions(name: str) -> dict:
    return {a.dest: a for a in _command(name)._actions}


def test_every_option_is_a_flag_of_find_or_named_as_without_one():
    fields = {f.name for f in dataclasses.fields(FindOptions)}
    assert set(FIND_FLAGS) | UNFLAGGED == fields and not set(FIND_FLAGS) & UNFLAGGED


def test_the_flags_keep_their_names_and_carry_the_fields_help():
    actions = _actions("find")
    for name, flag in FLAGS.items():
        action = actions[name]
        assert action.option_strings == [flag]
        own = option_help(name).partition("; None: ")[0]
        assert own in action.help.replace("%%", "%"), f"{flag}'s help is not {name}'s documentation"
    # train's --target and --strategy are the same options, with what they mean for training
    train = _actions("train")
    assert train["target"].option_strings == ["--target"] and train["strategy"].option_strings == ["--strategy"]
    assert option_help("target").partition("; None: ")[0] in train["target"].help and "below 0.95" in train["target"].help


def test_the_flags_set_the_options_and_leave_the_rest_at_their_defaults():
    parse = _command("find").parse_args
    assert find_options_of(parse([])) == FindOptions(objective="memory", progress=True)
    args = parse(["--capacity", "2MiB", "--target", "0.5", "--max-batch-size", "8", "--strategy", "binsearch",
                  "--timed-steps", "0", "--no-progress", "--speed-tolerance", "0.1", "--steps-per-trial", "3"])
    assert find_options_of(args) == FindOptions(capacity=parse_bytes("2MiB"), target=0.5, max_batch_size=8,
                                                strategy="binsearch", timed_steps=0, progress=False, objective="memory",
                                                speed_tolerance=0.1, steps_per_trial=3)


@pytest.mark.parametrize("text", ["3,224,224", "3x224x224", "3X224X224", "3x224,224", " 3, 224, 224 "])
def test_an_input_shape_is_separated_by_commas_or_x(text):
    # docs/cli.md: --input-shape 3x224x224 is 3,224,224
    assert shape(text) == (3, 224, 224)
    assert build_parser().parse_args(["plan", "--input-shape", text, "--capacity", "1MiB"]).input_shape == (3, 224, 224)


@pytest.mark.parametrize("text", ["3*224*224", "3;224", "", "3x0x4", "-3"])
def test_an_input_shape_that_is_no_shape_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        shape(text)
