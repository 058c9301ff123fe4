"""Bounded thread pools for the front end's slow work: tokenizing long texts, converting
JSON schemas (which waits for a worker process). The event loop hands such work to a pool
and keeps serving; each kind of work has its own few threads, so one kind cannot take the
threads of the other (or the loop's default pool), and a bounded number of jobs may wait:
past it a call is refused with 503 and Retry-After instead of queueing without end."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spruce.runtime.limits import ServingLimits
from spruce.runtime.server.request_manager import Refused


class WorkPool:
    def __init__(
        self,
        name: str,
        threads: int,
        max_waiting: int,
        retry_after_s: int = ServingLimits.retry_after_s,
    ) -> None:
        self.name, self.retry_after_s = name, retry_after_s
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix=f"spruce-{name}")
        self.slots = threading.BoundedSemaphore(threads + max_waiting)  # jobs running or waiting

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on a pool thread. A slot is held until fn returns (or its job is
        cancelled before it starts), even when the caller is cancelled because its client
        left: the bound counts the work that really runs."""
        if not self.slots.acquire(blocking=False):
            raise Refused(
                503,
                f"the server's {self.name} workers are all busy; retry later",
                self.retry_after_s,
            )
        try:
            future = self.executor.submit(fn, *args)
        except BaseException:
            self.slots.release()
            raise
        future.add_done_callback(lambda _: self.slots.release())
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class FrontPools:
    """One pool per kind of work: `tokenize` (long prompts, /tokenize, /detokenize) and
    `convert` (constrained requests: schema conversion waits for a worker process, and only
    a few run at once, so their waiters must not hold the tokenizing threads)."""

    def __init__(self, retry_after_s: int = ServingLimits.retry_after_s) -> None:
        self.tokenize = WorkPool("tokenize", threads=2, max_waiting=64, retry_after_s=retry_after_s)
        self.convert = WorkPool("convert", threads=4, max_waiting=64, retry_after_s=retry_after_s)

    def close(self) -> None:
        self.tokenize.close()
        self.convert.close()
