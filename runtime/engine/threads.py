"""How many CPU threads a step uses: all of them while the cores are free, fewer while other
processes want them.

The OpenMP threads spin briefly before they sleep (`config.use_omp_wait_policy`): a batch-1
decode step is ~200 small parallel regions, and waking a sleeping thread for each costs more
than the region on some hosts. A spinning thread, though, holds a core another process needs.
So between steps (at most every PERIOD_S) the engine reads how many threads of other
processes are runnable (`/proc/loadavg`'s count for the machine less this process's own
runnable threads), and while others want the cores it runs with only the threads the free
cores can take (at least one); it goes back up when they leave. (Counting this process's own
OpenMP threads, caught spinning, as others made it switch between one and two threads every
other period on a quiet machine: 9 switches in 8 batch-1 generations, none since.)

Measured on a 2-core AMD EPYC VM, bundled model, 2 threads, medians of 2-3 runs in fresh
processes (2026-12-03; `busy`: one `while True` process beside it):

| policy | batch-1 tok/s quiet | batch-64 step quiet | batch-64 step busy | batch-1 tok/s busy |
| --- | --- | --- | --- | --- |
| OMP_WAIT_POLICY=PASSIVE (the old default) | 79 | 159 ms | 253 ms | 85 |
| spin 3000, fixed threads | 142 | 145 ms | 317 ms | 38 |
| spin 3000 + this governor (the default) | 132 | 159 ms | 253 ms | 94 |
| libgomp's default spin (300,000), fixed | 123 | 152 ms | 443 ms | 35 |

The batch-64 step again once the integer GEMM took its matmuls (cpu_quant_igemm.c; same VM,
2026-12-03, one run each, alternated): quiet 99-124 ms; busy, with this governor (one
thread) 172-185 ms, with two fixed threads 226-229 ms, with three fixed threads 195 ms. One
thread beside a busy process thus costs 1.5-1.8x the quiet step: about what two threads gain
over one when the cores are free, which no policy that leaves the other process its whole
core can beat on two cores. Again with the batch-1 matmuls' rows shared out between threads
(2026-12-04; 64 requests of 128 prompt + 40 generated tokens, the median decode step of
two alternated runs each): quiet 81 ms; busy with this governor (one thread) 148 ms, 1.81x,
what two threads gain over one on free cores; busy with two fixed threads 249 ms.

With one core left (this governor's one thread), a step of 32 rows or more runs instead
in two parts of rows, each through the layers on a thread of its own
(decode_plan.set_row_parts; cpu_decode_step.c): a thread the busy process displaces then
holds up its own part, not the other thread at the end of every kernel. The parts cost more
work (the integer GEMM widens each weight panel once per call, so each part pays that
again: on one thread 218 ms in two parts against 192 ms whole). For the call the two
threads are pinned to different CPUs: left free, the system often kept both on one core
while the busy process had the other alone, and they got 1.21-1.28 cores; pinned apart,
the busy process shares a core with one of them, and they get 1.39-1.41. The thread alone
on its core finishes its part first and then takes weight panels of the GEMMs the other
part's thread is running (cpu_team.c) rather than wait. Measured on the 2-core Intel Xeon
VM, 2026-12-05, 64 requests of 128 prompt + 24 generated tokens, the median decode step
beside the busy process, alternated runs of two rounds each: 136-152 ms (1.53-1.67x the
quiet step) with the parts alone, 131-142 ms (1.49-1.50x) pinned, 127-138 ms (1.37-1.46x)
pinned and helping. Not kept, as no difference showed: leaving a part between layers to a
faster idle thread, and helping with the attention too. Four parts of 16 rows cost more
than they gained (307 ms on one thread), and so did three threads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from spruce.runtime.cores import default_threads
from spruce.runtime.models.decode_plan import set_row_parts

PERIOD_S = 0.25
LOADAVG = "/proc/loadavg"


def runnable_threads() -> int | None:
    """Threads runnable on the machine now (the 4th field of /proc/loadavg: "3/88"), this
    one included; None where the file is missing (not Linux)."""
    try:
        with open(LOADAVG) as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def own_runnable_threads() -> int:
    """Threads of this process runnable now (state R in /proc/self/task/*/stat), the caller
    included; 0 where the folder is missing."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        count += stat[stat.rindex(")") + 2] == "R"
    return count


def others_runnable() -> int | None:
    """Runnable threads of other processes (None where /proc/loadavg is missing). This
    process's own are counted before and after the machine's, and the larger count taken, so
    that a thread of ours that sleeps or wakes in between is not taken for another's."""
    before = own_runnable_threads()
    runnable = runnable_threads()
    if runnable is None:
        return None
    return max(runnable - max(before, own_runnable_threads()), 0)


ROW_PARTS = 2  # with one free core left: many-row decode steps in two parts, a thread each


class ThreadGovernor:
    """`check()` before a step: sets torch's (and the C kernels') thread count to what the
    cores not wanted by other work can take, at most `threads`; where that leaves one thread
    of two or more, many-row decode steps run in ROW_PARTS parts of rows instead, a thread
    each (`parts`; decode_plan.set_row_parts). A reading only counts when the one before it
    agreed (one runnable burst of a short-lived process changes nothing)."""

    def __init__(
        self,
        threads: int,
        cores: int | None = None,
        read: Callable[[], int | None] = others_runnable,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        set_parts: Callable[[int], None] = set_row_parts,
    ) -> None:
        self.threads, self.current = threads, threads
        self.cores = cores or default_threads()
        self.read, self.set_threads, self.set_parts = read, set_threads, set_parts
        self.checked_at = 0.0
        self.last_want = threads

    def check(self) -> None:
        now = time.monotonic()
        if now - self.checked_at < PERIOD_S:
            return
        self.checked_at = now
        others = self.read()
        if others is None:
            return
        want = max(1, min(self.threads, self.cores - others))
        if want == self.last_want and want != self.current:
            self.set_threads(want)
            self.current = want
            self.set_parts(self.parts)
        self.last_want = want

    @property
    def parts(self) -> int:
        """Parts of rows for many-row decode steps at the current count (0: whole)."""
        return ROW_PARTS if self.current == 1 and self.threads >= ROW_PARTS else 0
