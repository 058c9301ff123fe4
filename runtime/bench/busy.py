"""The decode step beside a competing process (`spruce bench offline --busy`).

A batch of 64 sequences decodes once alone on the machine and once beside one busy process
(a Python loop that never sleeps, started by the benchmark), with the engine's own thread
policy: the wait policy and the governor that gives cores back while others want them and,
with one core left, runs the batch in parts of rows, a thread each, the threads pinned to
different CPUs and the one done first helping the other's GEMMs (engine/threads.py).
Rounds alternate which goes first, so a host's slow minutes fall on both. The figure is the
median over the rounds of the busy step over the quiet one, with the thread count (and row
parts) the governor settled on beside the busy process.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from spruce.runtime.bench import alternating_rounds
from spruce.runtime.engine.threads import PERIOD_S

SEQUENCES = 64
ROUNDS = 3


@contextlib.contextmanager
def busy_process() -> Iterator[subprocess.Popen]:
    """One process spinning on a core until the block ends (then killed and reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def busy_rounds(measure: Callable[[], float], rounds: int, busy=busy_process) -> dict:
    """`measure()` (a step in ms) alone and inside `busy()`, `rounds` times, who goes first
    alternating: each side's results, their medians, and the median of the rounds' ratios
    (the two runs of a round are back to back: this VM's speed moved 2x between rounds)."""

    def beside_busy() -> float:
        with busy():
            return measure()

    quiet, loaded = alternating_rounds(measure, beside_busy, rounds)
    ratios = [b / q for q, b in zip(quiet, loaded)]
    return {"quiet_step_ms": statistics.median(quiet), "busy_step_ms": statistics.median(loaded),
            "busy_over_quiet": statistics.median(ratios), "quiet_rounds": quiet,
            "busy_rounds": loaded}  # fmt: skip


def busy_probe(engine, prompts: list[list[int]], run_engine) -> dict:
    """The decode step of `prompts` (SEQUENCES of them, from offline.py, whose run_engine
    times a run) quiet and beside one busy process, 24 tokens each; the prompts are cached
    first, so the runs are mostly decode."""
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})
    threads, parts = [], []
    governor = engine.core.governor

    def measure() -> float:
        threads.append(settle(governor, engine.config.num_threads))
        parts.append(0 if governor is None else governor.parts)
        return run_engine(engine, prompts, params)["decode_step_ms"]

    result = busy_rounds(measure, ROUNDS)
    result["threads"], result["sequences"] = engine.config.num_threads, len(prompts)
    result["threads_beside_busy"] = min(threads)  # the quiet runs read the full count
    result["row_parts_beside_busy"] = max(parts)  # and no parts
    return result


def settle(governor, threads: int) -> int:
    """Lets the governor (None: fixed threads) see the machine as it is now before a run: it
    reads the load only between steps, at most every PERIOD_S, and acts on two agreeing
    readings, so a run's first steps would otherwise keep the count of the run before.
    Returns the thread count it settled on."""
    if governor is None:
        return threads
    for _ in range(3):
        time.sleep(PERIOD_S + 0.05)
        governor.check()
    return governor.current


def print_busy(r: dict) -> None:
    rounds = ", ".join(f"{q:.0f}/{b:.0f}" for q, b in zip(r["quiet_rounds"], r["busy_rounds"]))
    n = r.get("row_parts_beside_busy", 0)
    parts = f", the batch in {n} parts of rows, a thread each" if n > 1 else ""
    print(
        f"beside a busy process  batch-{r['sequences']} decode step {r['busy_step_ms']:.1f} ms, quiet "
        f"{r['quiet_step_ms']:.1f} ms, {r['busy_over_quiet']:.2f}x (medians; quiet/busy by round "
        f"{rounds} ms; {r['threads_beside_busy']} of {r['threads']} threads beside it{parts})"
    )
