"""Supervision of the front end's long-lived tasks (the scheduler receiver, the ZeroMQ
socket, the throughput log).

A task that fails is logged and restarted after a short pause; while it is down, /health
answers 503 naming it. A task that fails more than `max_restarts` times within `window_s`
is given up on: `on_give_up(reason)` is called (the launcher shuts the server down with
exit code 1), so a front end that cannot serve never pretends to be healthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

logger = logging.getLogger("spruce.server")
RESTART_DELAY_S = 0.2


class Supervisor:
    def __init__(
        self, on_give_up: Callable[[str], None], max_restarts: int = 5, window_s: float = 60.0,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        self.on_give_up = on_give_up
        self.on_restart = on_restart  # metrics: a task restarted
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.down: dict[str, str] = {}  # task name -> why it is restarting
        self.gave_up: str | None = None
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self, name: str, factory: Callable[[], Awaitable[None]]) -> asyncio.Task:
        """Runs `factory()` until it returns, restarting it when it raises."""
        task = asyncio.ensure_future(self._run(name, factory))
        self.tasks[name] = task
        return task

    def problem(self) -> str | None:
        """Why the front end is not fully serving, or None (for /health)."""
        if self.gave_up is not None:
            return self.gave_up
        if self.down:
            down = self.down.items()
            return "; ".join(
                f"the {name} task failed and is restarting" for name, _ in down
            )  # why: in the log
        return None

    async def _run(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        failures: deque[float] = deque()
        while True:
            try:
                await factory()
                return
            except Exception as e:  # CancelledError is not an Exception: a cancel stops the task
                logger.exception("the %s task failed", name)
                if not self._may_restart(name, failures, e):
                    return
            await asyncio.sleep(RESTART_DELAY_S)
            self.down.pop(name, None)

    def _may_restart(self, name: str, failures: deque[float], error: Exception) -> bool:
        now = time.monotonic()
        failures.append(now)
        while failures and failures[0] < now - self.window_s:
            failures.popleft()
        if len(failures) > self.max_restarts:
            self.gave_up = (
                f"the {name} task failed {len(failures)} times within {self.window_s:g} s"
            )
            logger.error("%s (last: %r); giving up", self.gave_up, error)
            self.on_give_up(self.gave_up)
            return False
        self.down[name] = repr(error)
        if self.on_restart is not None:
            self.on_restart(name)
        return True
