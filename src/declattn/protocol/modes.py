"""The attention modes a model can declare."""

from enum import StrEnum


class Mode(StrEnum):
    """What the next decode step may read.

    ``ANSWER`` reads what ``LOCAL`` reads; it is kept apart only so accounting and
    display can tell the final answer from local reasoning.
    """

    GLOBAL = "global"
    FOCUS = "focus"
    LOCAL = "local"
    ANSWER = "answer"
