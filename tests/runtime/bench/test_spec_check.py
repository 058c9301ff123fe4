"""spruce bench spec's check of outputs that differ: decoded again alone, a difference there
fails the benchmark (a verification bug), one only in the batch is counted as a near-tie."""

from __future__ import annotations

import pytest

from spruce.runtime.bench.spec import check_alone


class FakeEngine:
    """Answers each prompt alone with `alone[prompt]`; records flushes."""

    def __init__(self, alone: dict[tuple, list[int]]) -> None:
        self.alone, self.flushes, self.asked = alone, 0, []

    def flush_cache(self) -> None:
        self.flushes += 1

    def generate(self, input_ids, sampling_params) -> dict:
        self.asked.append(input_ids)
        return {"output_ids": self.alone[tuple(input_ids)]}


PROMPTS = [[1, 2], [3, 4], [5, 6]]
PARAMS = [{"temperature": 0}] * 3


def test_a_difference_only_in_the_batch_is_a_near_tie(capsys):
    off = FakeEngine({(3, 4): [7, 8]})
    on = FakeEngine({(3, 4): [7, 8]})
    check_alone(off, on, PROMPTS, PARAMS, [1])
    assert off.asked == on.asked == [[3, 4]]  # only the request that differed, on both
    assert off.flushes == on.flushes == 1  # alone from a cold cache
    assert "not alone (requests [1])" in capsys.readouterr().out


def test_a_difference_alone_fails_the_benchmark():
    off = FakeEngine({(3, 4): [7, 8], (5, 6): [9]})
    on = FakeEngine({(3, 4): [7, 8], (5, 6): [10]})
    with pytest.raises(SystemExit, match="request 2 decoded alone: a bug"):
        check_alone(off, on, PROMPTS, PARAMS, [1, 2])


def test_nothing_differs_nothing_runs():
    off, on = FakeEngine({}), FakeEngine({})
    check_alone(off, on, PROMPTS, PARAMS, [])
    assert off.flushes == on.flushes == 0 and not off.asked and not on.asked
