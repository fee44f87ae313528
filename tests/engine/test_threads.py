"""Thread choice from idle cores measured in ``/proc/stat`` (a fake reader: no timing)."""

from __future__ import annotations

import pytest

from declattn.engine import threads
from declattn.engine.threads import CpuTimes, choose_threads, idle_cores, suggest_threads


def stat(user: int, idle: int, iowait: int = 0, cpus: int = 2) -> str:
    """A /proc/stat text whose summed line has these ticks (and ``cpus`` core lines)."""
    cores = "".join(f"cpu{i} 1 0 1 1 0 0 0 0 0 0\n" for i in range(cpus))
    return f"cpu  {user} 0 10 {idle} {iowait} 0 0 0 0 0\n{cores}intr 1 2 3\nctxt 99\n"


def reader(*texts: str | None):
    it = iter(texts)
    return lambda: next(it)


def test_parse_sums_the_busy_and_idle_ticks_and_counts_the_cores():
    t = CpuTimes.parse(stat(user=100, idle=50, iowait=5, cpus=4))
    assert (t.idle, t.total, t.cpus) == (55, 165, 4)
    with pytest.raises(ValueError):
        CpuTimes.parse("intr 1 2\n")


def test_idle_cores_is_the_idle_share_of_the_window_times_the_cores():
    waited = []
    # 200 ticks pass on 2 cores: 150 idle -> 1.5 cores idle
    got = idle_cores(reader(stat(1000, 1000), stat(1050, 1150)), waited.append, 0.25)
    assert got == pytest.approx(1.5)
    assert waited == [0.25]  # one window between the two reads
    # a machine busy on both cores
    assert idle_cores(reader(stat(0, 0), stat(200, 0)), lambda _: None) == 0.0


def test_idle_cores_is_unknown_without_a_readable_or_moving_stat():
    assert idle_cores(reader(None, None), lambda _: None) is None
    assert idle_cores(reader("garbage", "garbage"), lambda _: None) is None
    same = stat(10, 10)
    assert idle_cores(reader(same, same), lambda _: None) is None


def test_a_quiet_machine_gets_every_core_a_busy_one_fewer():
    # the install just finished: the load average would say busy, the cores are idle now
    assert suggest_threads(cores=2, idle=1.9) == 2
    assert suggest_threads(cores=2, idle=1.2) == 1
    assert suggest_threads(cores=2, idle=0.1) == 1  # never fewer than one
    assert suggest_threads(cores=8, idle=5.6) == 6
    assert suggest_threads(cores=2, idle=7.0) == 2  # never more than this process may use
    assert suggest_threads(cores=4, idle=None) == 4  # unknown: every core


def test_choose_threads_says_why(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    c = choose_threads(measure=lambda: 1.8)
    assert c.threads == 2 and "1.8 cores idle" in c.line() and "of 2 cores" in c.line()
    assert choose_threads(measure=lambda: 0.7).threads == 1
    assert "could not be measured" in choose_threads(measure=lambda: None).reason
    asked = choose_threads(1, measure=lambda: pytest.fail("measured although told"))
    assert (asked.threads, asked.reason) == (1, "as asked")
