"""Attended-token accounting: per decode step, DA reads against vanilla reads.

Replay and the live engine session both feed this one accumulator, so a figure from
a replayed transcript and one from a live run are counted the same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from declattn.da.scope import StepCount
from declattn.protocol.modes import Mode

_FIELDS = ("logical", "physical", "vanilla_logical", "vanilla_physical")


@dataclass
class StepRecord:
    """One decode step: the scope it read under and what it attended.

    ``index`` is the output token the step produced (token 0 comes from prefill and
    has no record); ``length`` is the number of positions the step could see.
    """

    index: int
    mode: Mode
    focus_ids: tuple[int, ...]
    length: int
    logical: int
    physical: int
    vanilla_logical: int
    vanilla_physical: int

    @classmethod
    def from_count(
        cls, index: int, mode: Mode, focus_ids: tuple[int, ...], length: int, count: StepCount
    ) -> StepRecord:
        c = count  # its fields one by one: ``asdict`` copies deeply, once per decode step
        return cls(index, Mode(mode), tuple(focus_ids), length, c.logical, c.physical,
                   c.vanilla_logical, c.vanilla_physical)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mode"] = str(self.mode)
        d["focus_ids"] = list(self.focus_ids)
        return d


def saving(da: int, vanilla: int) -> float:
    """Fraction of vanilla reads avoided; 0.0 when nothing was read."""
    return 1.0 - da / vanilla if vanilla else 0.0


class Accounting:
    """Running sums of attended tokens, overall and per mode."""

    def __init__(self) -> None:
        self._steps = 0
        self._sums = dict.fromkeys(_FIELDS, 0)
        self._modes: dict[Mode, dict[str, int]] = {
            m: {"steps": 0, **dict.fromkeys(_FIELDS, 0)} for m in Mode
        }

    def add(self, step: StepRecord) -> None:
        mode = Mode(step.mode)
        self._steps += 1
        self._modes[mode]["steps"] += 1
        for f in _FIELDS:
            v = getattr(step, f)
            self._sums[f] += v
            self._modes[mode][f] += v

    @property
    def steps(self) -> int:
        return self._steps

    def totals(self) -> dict[str, Any]:
        """Sums over all steps plus the logical and physical saving fractions."""
        s = self._sums
        return {
            "steps": self._steps,
            **s,
            "logical_saving": saving(s["logical"], s["vanilla_logical"]),
            "physical_saving": saving(s["physical"], s["vanilla_physical"]),
        }

    def by_mode(self) -> dict[Mode, dict[str, int]]:
        """Per mode (every mode listed, in ``Mode`` order): steps and sums."""
        return {m: dict(v) for m, v in self._modes.items()}
