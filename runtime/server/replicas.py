"""The scheduler replicas (`--dp N`) as the front end sees them: one inbox socket each, the
requests in flight on each (its load, as the router counts it), what each last said about
its queues, and whether it is alive.

`assign` picks a replica for each prompt of a call with the router (router.py); equal
prompts of one call (`n` choices, a batch repeating a prompt) go to the same replica, and
prompts sharing a prefix follow it there through the router's prefix trie (DSL `fork`
branches, `run_batch` programs over one few-shot prefix). With one replica everything goes
to replica 0 and the router is never asked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq

from spruce.runtime.protocol.ipc import encode
from spruce.runtime.scheduler.router import CacheAwareRouter


class SchedulerUnavailable(Exception):
    """The scheduler did not answer (dead, shutting down or too busy)."""


@dataclass(slots=True)
class Replica:
    index: int
    sender: zmq.Socket  # PUSH, a plain (blocking-API) socket with no high-water mark: never waits
    in_flight: int = 0  # requests sent here and not finished (the router's load)
    running: int = 0  # from the replica's latest step output
    waiting: int = 0
    dead: str | None = None  # why, once the process is gone
    heard_at: float = field(
        default_factory=time.monotonic
    )  # its latest message (a heartbeat at least)
    stalled: str | None = None  # why, while it has not been heard from for --scheduler-timeout-s

    def info(self) -> dict:
        return {
            "replica": self.index, "alive": self.dead is None, "in_flight_requests": self.in_flight,
            "running_requests": self.running, "waiting_requests": self.waiting, "dead_reason": self.dead,
            "stalled_reason": self.stalled,
        }  # fmt: skip


class Replicas:
    def __init__(self, senders: list[zmq.Socket], router=None) -> None:
        assert senders
        self.all = [Replica(i, s) for i, s in enumerate(senders)]
        self.router = router or CacheAwareRouter(len(senders))

    def __len__(self) -> int:
        return len(self.all)

    def live(self) -> list[Replica]:
        return [r for r in self.all if r.dead is None]

    def assign(self, prompts: list[list[int]]) -> list[int]:
        """A replica index for each prompt; counts each as in flight there."""
        chosen: dict[tuple[int, ...], int] = {}
        out = []
        for ids in prompts:
            key = tuple(ids)
            if key not in chosen:
                chosen[key] = self._route(ids)
            out.append(chosen[key])
            self.all[chosen[key]].in_flight += 1
        return out

    def _route(self, ids: list[int]) -> int:
        if len(self.all) == 1:
            return 0
        if not self.live():
            return 0  # the caller fails the request (nothing alive to send to)
        return self.router.route(ids, [r.in_flight for r in self.all])

    def finished(self, index: int) -> None:
        self.all[index].in_flight -= 1

    def send(self, index: int, msg, even_stalled: bool = False) -> None:
        """Never waits: with the scheduler not connected (gone, or stopping) the message fails;
        so does one to a stalled scheduler, unless `even_stalled` (aborts)."""
        replica = self.all[index]
        if replica.dead:
            raise SchedulerUnavailable(replica.dead)
        if replica.stalled and not even_stalled:
            raise SchedulerUnavailable(replica.stalled)
        try:
            replica.sender.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            raise SchedulerUnavailable("the scheduler is not connected") from None

    def mark_dead(self, index: int, reason: str) -> None:
        self.all[index].dead = reason
        self.router.mark_dead(index)

    def flushed(self, index: int) -> None:
        """The replica's cache was emptied: the router forgets what it thought was there."""
        self.router.forget(index)

    def close(self) -> None:
        for replica in self.all:
            replica.sender.close(linger=500)


def merge_stats(answers: dict[int, dict]) -> dict:
    """Stats of several replicas as one: counts summed, the latest time, and each replica's
    own under "replicas"."""
    first = next(iter(answers.values()))
    out = {}
    for key, value in first.items():
        values = [a[key] for a in answers.values()]
        if key == "time":
            out[key] = max(values)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = sum(values)
        else:
            out[key] = value
    out["replicas"] = [dict(data, replica=index) for index, data in sorted(answers.items())]
    return out
