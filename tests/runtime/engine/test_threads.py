"""The thread governor with a stand-in for /proc/loadavg: fewer threads while other work
wants the cores (after two agreeing readings), all of them again when it leaves."""

from __future__ import annotations

import spruce.runtime.engine.threads as threads
from spruce.runtime.engine.threads import ThreadGovernor, runnable_threads


def governor(readings: list[int | None], threads_: int = 2, cores: int = 2):
    calls: list[int] = []
    g = ThreadGovernor(threads_, cores, read=lambda: readings.pop(0), set_threads=calls.append)
    return g, calls


def step(g: ThreadGovernor, times: int = 1) -> None:
    for _ in range(times):
        g.checked_at = -1e9  # as if PERIOD_S had passed
        g.check()


def test_fewer_threads_while_others_run_and_back_when_they_leave():
    g, calls = governor([1, 2, 2, 2, 1, 1])
    step(g, 2)  # quiet, then one reading of a busy process: nothing changes yet
    assert calls == [] and g.current == 2
    step(g)  # the second reading agrees: one thread
    assert calls == [1] and g.current == 1
    step(g, 3)  # still busy, then quiet twice: back to two
    assert calls == [1, 2] and g.current == 2


def test_enough_free_cores_change_nothing_and_no_reading_changes_nothing():
    g, calls = governor([3, 3, 3], threads_=2, cores=8)
    step(g, 3)
    assert calls == []
    g, calls = governor([None, None])
    step(g, 2)
    assert calls == [] and g.current == 2


def test_a_check_within_the_period_reads_nothing(monkeypatch):
    g, calls = governor([])  # a read would fail: the list is empty
    g.checked_at = threads.time.monotonic()
    g.check()
    assert calls == []


def test_the_reading_of_this_machine():
    value = runnable_threads()
    assert value is None or value >= 1  # this test's own thread is running
