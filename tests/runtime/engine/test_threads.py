"""The thread governor with a stand-in for the count of other processes' runnable threads:
fewer threads while other work wants the cores (after two agreeing readings), all of them
again when it leaves; and the count itself, which leaves this process's own threads out."""

from __future__ import annotations

import spruce.runtime.engine.threads as threads
from spruce.runtime.engine.threads import (
    ThreadGovernor,
    others_runnable,
    own_runnable_threads,
    runnable_threads,
)


def governor(readings: list[int | None], threads_: int = 2, cores: int = 2, parts=None):
    calls: list[int] = []
    parts = [] if parts is None else parts
    g = ThreadGovernor(
        threads_,
        cores,
        read=lambda: readings.pop(0),
        set_threads=calls.append,
        set_parts=parts.append,
    )
    return g, calls


def step(g: ThreadGovernor, times: int = 1) -> None:
    for _ in range(times):
        g.checked_at = -1e9  # as if PERIOD_S had passed
        g.check()


def test_fewer_threads_while_others_run_and_back_when_they_leave():
    g, calls = governor([0, 1, 1, 1, 0, 0])
    step(g, 2)  # quiet, then one reading of a busy process: nothing changes yet
    assert calls == [] and g.current == 2
    step(g)  # the second reading agrees: one thread
    assert calls == [1] and g.current == 1
    step(g, 3)  # still busy, then quiet twice: back to two
    assert calls == [1, 2] and g.current == 2


def test_enough_free_cores_change_nothing_and_no_reading_changes_nothing():
    g, calls = governor([2, 2, 2], threads_=2, cores=8)
    step(g, 3)
    assert calls == []
    g, calls = governor([None, None])
    step(g, 2)
    assert calls == [] and g.current == 2


def test_one_thread_left_of_several_runs_many_rows_in_parts():
    """Where others leave one core, many-row steps run in ROW_PARTS parts of rows (a thread
    each) rather than on one thread; off again when the cores are free, and never where
    fewer threads are asked for or more than one core is free."""
    parts: list[int] = []
    g, calls = governor([1, 1, 0, 0], parts=parts)
    step(g, 2)
    assert calls == [1] and parts == [threads.ROW_PARTS] and g.parts == threads.ROW_PARTS
    step(g, 2)
    assert calls == [1, 2] and parts == [threads.ROW_PARTS, 0] and g.parts == 0
    parts.clear()
    g, calls = governor([2, 2], threads_=4, cores=4, parts=parts)
    step(g, 2)  # two cores free: two threads on the kernels, no parts
    assert calls == [2] and parts == [0]
    parts.clear()
    g, calls = governor([3, 3], threads_=1, cores=4, parts=parts)
    step(g, 2)
    assert calls == [] and parts == []


def test_a_check_within_the_period_reads_nothing(monkeypatch):
    g, calls = governor([])  # a read would fail: the list is empty
    g.checked_at = threads.time.monotonic()
    g.check()
    assert calls == []


def test_the_reading_of_this_machine():
    value = runnable_threads()
    assert value is None or value >= 1  # this test's own thread is running


def test_own_threads_are_not_others(monkeypatch):
    """The machine's runnable count less this process's own (the larger of the counts taken
    before and after it): the governor once took its own spinning OpenMP threads for others."""
    own = [1, 2, 0]
    monkeypatch.setattr(threads, "runnable_threads", lambda: 3)
    monkeypatch.setattr(threads, "own_runnable_threads", lambda: own.pop(0))
    assert others_runnable() == 1
    monkeypatch.setattr(threads, "runnable_threads", lambda: None)
    assert others_runnable() is None


def test_this_process_counts_its_running_caller():
    own = own_runnable_threads()
    assert own == 0 or own >= 1  # 0 only without /proc
    machine = runnable_threads()
    if machine is not None:
        assert own >= 1
