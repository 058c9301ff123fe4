"""`spruce bench offline --busy` (bench/busy.py): the rounds alternate and time the busy side
while the competing process runs, the process is a real one that is gone afterwards, and
the governor is settled on the machine as it is before each run."""

from __future__ import annotations

import contextlib

import pytest

from spruce.runtime.bench import busy
from spruce.runtime.engine import threads
from spruce.runtime.engine.threads import ThreadGovernor


def test_rounds_alternate_and_time_the_busy_side_inside_the_busy_block():
    state, seen, steps = {"busy": False}, [], iter([100.0, 180.0, 170.0, 90.0, 110.0, 160.0])

    @contextlib.contextmanager
    def fake_busy():
        state["busy"] = True
        yield
        state["busy"] = False

    def measure() -> float:
        seen.append("busy" if state["busy"] else "quiet")
        return next(steps)

    r = busy.busy_rounds(measure, 3, busy=fake_busy)
    assert seen == ["quiet", "busy", "busy", "quiet", "quiet", "busy"]
    assert r["quiet_rounds"] == [100.0, 90.0, 110.0] and r["busy_rounds"] == [180.0, 170.0, 160.0]
    assert r["quiet_step_ms"] == 100.0 and r["busy_step_ms"] == 170.0
    # the rounds' ratios 1.8, 1.89, 1.45: their median, not the medians' ratio (1.7)
    assert r["busy_over_quiet"] == pytest.approx(1.8)


def test_busy_process_runs_during_the_block_and_is_reaped_after():
    with busy.busy_process() as child:
        assert child.poll() is None  # still running: it never sleeps or exits
    assert child.returncode is not None


def test_settle_brings_the_governor_to_the_machine_as_it_is(monkeypatch):
    monkeypatch.setattr(busy, "PERIOD_S", 0.01)
    monkeypatch.setattr(threads, "PERIOD_S", 0.01)
    others, set_to = [1], []
    governor = ThreadGovernor(
        2, cores=2, read=lambda: others[0], set_threads=set_to.append, set_parts=lambda n: None
    )
    assert busy.settle(governor, 2) == 1  # one other runnable thread: one core left
    others[0] = 0
    assert busy.settle(governor, 2) == 2
    assert set_to == [1, 2]
    assert busy.settle(None, 3) == 3  # no governor: the fixed count
