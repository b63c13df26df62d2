"""The notes an error gains on its way out of a search: where it ran, which its traceback does not show.

The error keeps its type (a ``ValueError`` stays a ``ValueError``, so the user's ``except``
clauses still match); a PEP 678 note names the batch size the trial ran at (the step was called
with a batch the finder built, not one of the user's) and, from a search at several sequence
lengths, the length. Every such note is written here.
"""

from __future__ import annotations

from ..policy.search import BatchSizeError

__all__ = ["add_note", "note_trial_error", "note_length_search", "length_note"]

_PREFIX = "batchpilot: raised by the step during a trial at "
# the figures already noted on an exception, so that nested trials (a length search around a
# batch search) leave one note that names both
_FACTS = "_batchpilot_trial"


def _set_notes(exc: BaseException, notes: list[str]) -> None:
    """``exc.__notes__ = notes``: what ``add_note`` appends to (3.11+ prints it under the traceback; 3.10 keeps it)."""
    try:
        exc.__notes__ = notes
    except Exception:  # an exception type that refuses attributes
        if hasattr(exc, "add_note"):
            exc.add_note(notes[-1])


def add_note(exc: BaseException, note: str) -> None:
    """Append ``note`` to ``exc`` (PEP 678), also on an exception type that refuses attributes."""
    _set_notes(exc, [*(getattr(exc, "__notes__", None) or []), note])


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
    try:
        setattr(exc, _FACTS, facts)
    except Exception:
        pass
    _set_notes(exc, [*notes, _PREFIX + ", ".join(parts)])


def length_note(length: int, ran: list[int], *, own: bool) -> str:
    """The note on an error raised in a search at ``length``; ``own``: the user's step raised it.

    ``ran`` are the lengths whose searches ran; a model that takes no sequences this long (a
    position table, a ``max_length``) gets advice that names none longer than those.
    """
    note = f"batchpilot: in the search at sequence length {length}"
    if not own or any(L > length for L in ran):  # a longer length ran: not the length's fault
        return note
    longest = f"the longest length that ran is {max(ran)}" if ran else "no length ran before it"
    return (f"{note} ({longest}); if the model takes no sequences of {length} tokens (a position table, a "
            "max_length), cut batches to the longest it takes, and find with lengths up to that")


def note_length_search(exc: BaseException, length: int, ran: list[int]) -> None:
    """Add :func:`length_note` to ``exc``, raised by a search at ``length`` after those at ``ran``.

    A :class:`BatchSizeError` is batchpilot's own (nothing fits): it is noted without the advice
    about the model's longest sequence, which only the user's step can be the cause of.
    """
    own = not isinstance(exc, BatchSizeError)
    _set_notes(exc, [*(getattr(exc, "__notes__", None) or []), length_note(length, ran, own=own)])
