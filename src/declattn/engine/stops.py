"""Stop strings: cut the output where one appears, and hold back a tail that may begin one.

The held text is released with the next token (or at the end), so a stop string split
over tokens is never half-shown.
"""

from __future__ import annotations

from collections.abc import Sequence


def cut_at_stop(
    held: str, text: str, stops: Sequence[str], may_hold: bool
) -> tuple[str, str, bool]:
    """``(text to show, text held back, stopped)`` for a token's ``text`` after ``held``.

    ``may_hold``: the response goes on, so a tail that may begin a stop string is held
    back (a finishing response shows everything up to a stop string it contains)."""
    if not stops:
        return text, held, False
    pending = held + text
    for stop in stops:
        at = pending.find(stop)
        if at >= 0:
            return pending[:at], "", True
    if not may_hold:
        return pending, "", False
    keep = len(pending)
    for stop in stops:
        for n in range(min(len(stop) - 1, len(pending)), 0, -1):
            if pending.endswith(stop[:n]):
                keep = min(keep, len(pending) - n)
                break
    return pending[:keep], pending[keep:], False
