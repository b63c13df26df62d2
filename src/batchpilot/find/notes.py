"""The note an error from the user's step gains when it is raised during a trial.

The error keeps its type (a ``ValueError`` stays a ``ValueError``, so the user's ``except``
clauses still match); a PEP 678 note names the size the trial ran at, which the traceback
alone does not show: the step was called with a batch the finder built, not one of the user's.
"""

from __future__ import annotations

__all__ = ["note_trial_error"]

_PREFIX = "batchpilot: raised by the step during a trial at "
# the figures already noted on an exception, so that nested trials (a length search around a
# batch search) leave one note that names both
_FACTS = "_batchpilot_trial"


def note_trial_error(exc: BaseException, *, batch_size: int | None = None, length: int | None = None) -> None:
    """Add (or complete) the note naming the trial's batch size and sequence length on ``exc``.

    Call it where the trial calls the step, and re-raise ``exc`` itself. The innermost call's
    figures win (it ran the step); an outer one adds what it alone knows, e.g. the length.
    Example note: ``batchpilot: raised by the step during a trial at batch size 64, sequence
    length 300``.
    """
    try:
        facts: dict[str, int] = dict(getattr(exc, _FACTS, {}))
    except Exception:  # an exception type that refuses attributes: note without merging
        facts = {}
    if batch_size is not None:
        facts.setdefault("batch_size", int(batch_size))
    if length is not None:
        facts.setdefault("length", int(length))
    if not facts:
        return
    parts = [f"batch size {facts['batch_size']}"] if "batch_size" in facts else []
    parts += [f"sequence length {facts['length']}"] if "length" in facts else []
    notes = [n for n in getattr(exc, "__notes__", None) or [] if not (isinstance(n, str) and n.startswith(_PREFIX))]
    notes.append(_PREFIX + ", ".join(parts))
    try:
        setattr(exc, _FACTS, facts)
        # what add_note appends to (Python 3.11+ prints it under the traceback; 3.10 keeps it)
        exc.__notes__ = notes
    except Exception:
        if hasattr(exc, "add_note"):
            exc.add_note(notes[-1])
