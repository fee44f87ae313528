"""The attention modes a model can declare."""

from enum import StrEnum


class Mode(StrEnum):
    """What the next decode step may read.

    ``ANSWER`` reads what ``LOCAL`` reads, or, for an answer opened inside a focus block,
    what that ``FOCUS`` reads; it is kept apart so accounting and display can tell the
    final answer from the rest.
    """

    GLOBAL = "global"
    FOCUS = "focus"
    LOCAL = "local"
    ANSWER = "answer"
