"""The finder's options: one dataclass, each option documented where it is declared.

:class:`FindOptions` is the one home of every option of :func:`~batchpilot.find.finder.find_batch_size`,
and of their defaults: :func:`~batchpilot.find.front.find_batch_size_for`, the engine
(``EngineConfig.find``), the integrations and the ``batchpilot find`` flags embed it rather than
declare the options again. A field's ``metadata["help"]`` is its documentation: the class
docstring below, the integrations' docs and the command line's ``--help`` are built from it (what
``None`` means, where it is allowed, ends the text as ``"; None: ..."``: the command line
shows it as "not given").
"""

from __future__ import annotations

import dataclasses
import difflib
import textwrap
from dataclasses import dataclass, field
from typing import Any, Literal

from .._checks import check_int, positive_int
from ..memory.units import parse_bytes
from ..policy.search import DEFAULT_TARGET, STRATEGIES, BatchSizeError, SearchPolicy, check_target
from ..policy.speed import SPEED_TOLERANCE, check_objective, check_speed_tolerance

__all__ = ["FindOptions", "option_default", "option_help"]

#: timed steps per fitting trial by objective when ``timed_steps`` is ``None``: one to report
#: samples/s, three (the fastest counts) where the answer depends on them
TIMED_STEPS = {"memory": 1, "throughput": 3}

#: keywords that moved, and where to (a removed spelling gets this instead of a bare "unknown")
_MOVED = {
    "find_options": "pass its keys as keywords of their own (max_trials=9) or options=FindOptions(...)",
}


def _option(default: Any, text: str) -> Any:
    """A field with its documentation: ``metadata["help"]`` serves the docstring, the integrations and ``--help``."""
    return field(default=default, metadata={"help": text})


@dataclass(kw_only=True)
class FindOptions:
    """The options of :func:`~batchpilot.find.finder.find_batch_size`, validated before any trial runs.

    Give them as keywords (``FindOptions(capacity="24GiB")``), or derive one from another with
    :meth:`build`, which refuses a misspelt name with the closest one. Every entry point that
    runs the finder takes ``options=`` and these fields as keyword overrides.

    Attributes:
        {attributes}

    Raises:
        BatchSizeError: target outside (0, 1], ``min_batch_size > max_batch_size``, a non-positive
            size or count, an unknown strategy or objective, ``speed_tolerance`` outside [0, 0.5),
            or ``timed_steps=0`` with the throughput objective.
    """

    target: float = _option(
        DEFAULT_TARGET, "fraction of the capacity a trial's peak may use, in (0, 1]; on a host, of what the job can "
             "still grow into. 0.6-0.8 leaves room for fragmentation and other processes")
    capacity: int | str | None = _option(
        None, "device memory in bytes or as a string (\"24GiB\") to emulate; None: the device's real memory")
    strategy: str | SearchPolicy = _option(
        "predict", "the search: \"predict\" (fit the memory line from small trials, jump, verify), "
                   "\"power\", \"binsearch\", \"decay\", or a batchpilot.policy.search.SearchPolicy")
    min_batch_size: int = _option(1, "the smallest batch size to consider")
    max_batch_size: int | None = _option(
        None, "the largest batch size to consider (e.g. the dataset length); None: no limit")
    steps_per_trial: int = _option(
        2, "steps per trial; 2 or more put lazily created optimizer state (Adam's moments) inside the "
           "measured peak")
    first_guess: int | None = _option(
        None, "a batch size to try first (e.g. the planner's); the start of power, binsearch and decay")
    max_trials: int = _option(25, "stop after this many trials, keeping the best so far")
    progress: bool | None = _option(
        None, "say each trial on stderr as it runs: True (plain lines where stderr is no terminal), False "
              "(log records only); None: on a terminal or in a notebook, else off, or as BATCHPILOT_PROGRESS "
              "(0 or 1) says")
    tolerance: float | None = _option(
        None, "predict stops once the answer is within this fraction of the boundary, in [0, 0.5); None: "
              "exact on emulated tensor bytes, 0.02 on real memory, whose peaks move between runs")
    snapshot: Literal["auto", "memory", "disk"] = _option(
        "auto", "where the copies of what is restored live: \"memory\", \"disk\" (a temporary file, so they "
                "do not compete with the job), or \"auto\": disk on a real CPU when they are 5% of the "
                "memory the job can still grow into, or more")
    objective: Literal["memory", "throughput"] | None = _option(
        None, "\"memory\": the largest batch that fits; \"throughput\": the smallest fitting batch within "
              "speed_tolerance of the best measured samples/s; None: memory, except throughput for "
              "find_batch_size_for(mode=\"eval\")")
    speed_tolerance: float = _option(
        SPEED_TOLERANCE, "the share of the best samples/s the throughput objective may give up, in [0, 0.5)")
    timed_steps: int | None = _option(
        None, "steps timed per fitting trial after a warm-up step, the fastest counting; None: 1 for "
              "memory (0 times nothing), 3 for throughput and for the engine's split by time")

    def __post_init__(self) -> None:
        check_target(self.target)  # the one check of a target (an entry point may add a tighter bound)
        if self.capacity is not None:
            try:
                self.capacity = parse_bytes(self.capacity)
            except ValueError as exc:
                raise BatchSizeError(str(exc)) from exc
        if not isinstance(self.strategy, SearchPolicy) and self.strategy not in STRATEGIES:
            raise BatchSizeError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        for name in ("min_batch_size", "steps_per_trial", "max_trials"):
            positive_int(name, getattr(self, name), error=BatchSizeError)
        for name in ("max_batch_size", "first_guess"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name), error=BatchSizeError)
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise BatchSizeError(
                f"min_batch_size {self.min_batch_size} is larger than max_batch_size {self.max_batch_size}; "
                "lower min_batch_size or raise max_batch_size (e.g. to the dataset length)"
            )
        if self.progress is not None and not isinstance(self.progress, bool):
            raise BatchSizeError(f"progress must be True, False or None (auto), got {self.progress!r}")
        if self.tolerance is not None and not (
            isinstance(self.tolerance, (int, float)) and not isinstance(self.tolerance, bool)
            and 0 <= self.tolerance < 0.5
        ):
            raise BatchSizeError(f"tolerance must be a fraction in [0, 0.5) or None (auto), got {self.tolerance!r}")
        if self.snapshot not in ("auto", "memory", "disk"):
            raise BatchSizeError(f"snapshot must be 'auto', 'memory' or 'disk', got {self.snapshot!r}")
        if self.objective is not None:
            check_objective(self.objective, error=BatchSizeError)
        self.speed_tolerance = check_speed_tolerance(self.speed_tolerance, error=BatchSizeError)
        if self.timed_steps is not None:
            if self.objective == "throughput":
                positive_int("timed_steps", self.timed_steps, " (the throughput objective needs timed steps)",
                             error=BatchSizeError)
            else:
                check_int("timed_steps", self.timed_steps, minimum=0, error=BatchSizeError)

    @classmethod
    def build(cls, base: FindOptions | None = None, /, **overrides: Any) -> FindOptions:
        """``base`` (default: every option at its default) with ``overrides`` in place of its values.

        The result is validated as a new instance is; ``base`` is left as it was.

        Raises:
            BatchSizeError: a keyword that is no option (the message names the closest one), or
                a value :class:`FindOptions` refuses; ``base`` of another type.
        """
        if base is not None and not isinstance(base, cls):
            raise BatchSizeError(f"options must be a batchpilot.FindOptions, got {type(base).__name__}: "
                                 "FindOptions(capacity=\"24GiB\"), or the options as keywords")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in overrides:
            if key not in names:
                raise BatchSizeError(_unknown(key, names))
        if base is None:
            return cls(**overrides)
        return dataclasses.replace(base, **overrides) if overrides else base

    def changed(self) -> dict[str, Any]:
        """The options that differ from their defaults, by name (what a caller set)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}

    def resolved(self, objective: Literal["memory", "throughput"] = "memory") -> FindOptions:
        """These options with ``objective`` (when ``None``) and ``timed_steps`` (when ``None``) decided.

        Raises:
            BatchSizeError: the decided values together are refused (``timed_steps=0`` with the
                throughput objective).
        """
        chosen = self.objective if self.objective is not None else objective
        steps = self.timed_steps if self.timed_steps is not None else TIMED_STEPS[chosen]
        if (chosen, steps) == (self.objective, self.timed_steps):
            return self
        return dataclasses.replace(self, objective=chosen, timed_steps=steps)


def option_default(name: str) -> Any:
    """The default of option ``name``: where another layer needs it, it reads it here.

    Raises:
        BatchSizeError: no option of that name (the closest named).
    """
    return _field(name).default


def option_help(name: str) -> str:
    """The documentation of option ``name``, one paragraph (for docstrings and ``--help``).

    Raises:
        BatchSizeError: no option of that name (the closest named).
    """
    return _field(name).metadata["help"]


def _field(name: str) -> dataclasses.Field:
    for f in dataclasses.fields(FindOptions):
        if f.name == name:
            return f
    raise BatchSizeError(_unknown(name, [f.name for f in dataclasses.fields(FindOptions)]))


def _unknown(key: str, names: list[str]) -> str:
    if key in _MOVED:
        return f"{key}= is not a finder option any more: {_MOVED[key]}"
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return f"unknown finder option {key!r}{hint} The options are the fields of FindOptions: {', '.join(names)}"


def _attributes() -> str:
    """The ``Attributes:`` entries of the class docstring, from the fields' help and defaults."""
    entries = []
    for f in dataclasses.fields(FindOptions):
        text = f"{f.name}: {f.metadata['help']}; default {f.default!r}."
        entries.append(textwrap.fill(text, width=96, initial_indent=" " * 8, subsequent_indent=" " * 12))
    return "\n".join(entries).lstrip()


FindOptions.__doc__ = FindOptions.__doc__.replace("{attributes}", _attributes())
