"""Prefill admission: the waiting queue, chunked prefill, admission under budgets.

Fairness: a step's prefill budget is split between the clients with prompt tokens to
compute (running chunked prompts and waiting requests), max-min fair (`fair_split`): a
client asking less than an equal share gets all it asks, the rest is shared equally by the
others. One client's large batch (64 long embeddings inputs, many long prompts) is then
computed piece by piece while another client's prompt is admitted at the next step. A share
a client cannot use (its request waits for KV memory or a row) is not handed on that step.
Requests carry their client in `Req.client` (the front end's client key; "" offline).
"""

from __future__ import annotations

from spruce.runtime.config import SchedulerOptions
from spruce.runtime.core.request import Req
from spruce.runtime.scheduler.cache import CacheManager
from spruce.runtime.scheduler.output import ScheduleOutput
from spruce.runtime.scheduler.policy import get_policy

IN_BATCH_SHARE_MIN = 32  # shared uncached tokens that make a request wait one step


class PrefillManager:
    """Owns the waiting queue. Each step it first continues running requests that still
    have several tokens to compute (chunked prompts, jump-forward text), then admits new
    requests in policy order while the token budget, free rows, `max_running_requests`
    and KV memory (keeping a reserve for the running requests' future tokens) allow."""

    def __init__(self, options: SchedulerOptions, cache: CacheManager) -> None:
        self.options = options
        self.cache = cache
        self.policy = get_policy(options.schedule_policy)
        self.waiting: list[Req] = []
        self._admitted = 0

    def demands(self, continuing: list[Req]) -> dict[str, int]:
        """Prompt tokens each client has left to compute (running chunked prompts, waiting
        requests): `fair_split` turns them into the step's shares."""
        demands: dict[str, int] = {}
        for req in [*continuing, *self.waiting]:
            demands[req.client] = demands.get(req.client, 0) + req.remaining
        return demands

    def continue_running(
        self, out: ScheduleOutput, reqs: list[Req], shares: dict[str, int]
    ) -> None:
        """Continues chunked prompts (or jump-forward text), each within its client's share."""
        for req in reqs:
            n = min(req.remaining, shares.get(req.client, 0))
            if n <= 0:
                continue
            slots = self.cache.alloc(n)
            if slots is None:
                break
            out.add(req, n, slots)
            shares[req.client] -= n

    def admit(self, out: ScheduleOutput, running: list[Req], shares: dict[str, int]) -> list[Req]:
        """Admits waiting requests into `out`, each within its client's share of the step's
        prefill budget; returns them (they join the running set)."""
        if not self.waiting or sum(shares.values()) <= 0:
            return []
        admitted: list[Req] = []
        reserve = self._outstanding(running, out)
        for req in self.policy(self.waiting, self.cache.prefix_cache, self.options.lpm_max_queue):
            budget = shares.get(req.client, 0)
            if budget <= 0:
                continue
            if not self._has_room(running, admitted, sum(shares.values())):
                break
            self.cache.admit(req)
            if self._shares_with_batch(req, admitted):
                self.cache.release(req)  # next step its prefix is cached: wait for it
                continue
            n = min(req.remaining, budget)
            need = req.remaining + self._future_tokens(req)
            slots = self.cache.alloc(n) if self.cache.available >= need + reserve else None
            if slots is None:
                self.cache.release(req)
                break
            reserve += need - n
            self._admitted += 1
            req.admit_order = self._admitted
            self.cache.count_admission(req)
            out.add(req, n, slots)
            admitted.append(req)
            shares[req.client] -= n
        admitted_ids = {id(r) for r in admitted}
        self.waiting = [r for r in self.waiting if id(r) not in admitted_ids]
        return admitted

    def _shares_with_batch(self, req: Req, admitted: list[Req]) -> bool:
        """True when a request admitted this step is about to compute a long stretch of
        this one's uncached tokens (in-batch prefix sharing: compute it once)."""
        if not self.cache.shares_prefixes:
            return False
        start = req.computed_len
        mine = req.token_ids(start, start + IN_BATCH_SHARE_MIN)
        if len(mine) < IN_BATCH_SHARE_MIN:
            return False
        return any(
            other.token_ids(start, start + IN_BATCH_SHARE_MIN) == mine for other in admitted[-64:]
        )

    def _has_room(self, running: list[Req], admitted: list[Req], budget: int) -> bool:
        count = len(running) + len(admitted)
        return (
            budget > 0
            and count < self.options.max_running_requests
            and self.cache.table.num_free_rows > 0
        )

    def _outstanding(self, running: list[Req], out: ScheduleOutput) -> int:
        """Slots the running requests will still need beyond this step: the rest of their
        prompts (or jump-forward text) and a share of their future output."""
        this_step = {id(item.req): item.num_tokens for item in out.scheduled}
        return sum(r.remaining - this_step.get(id(r), 0) + self._future_tokens(r) for r in running)

    def _future_tokens(self, req: Req) -> int:
        left = req.sampling.max_new_tokens - len(req.output_ids)
        return int(self.options.decode_reserve_ratio * max(left, 0))


def fair_split(demands: dict[str, int], budget: int) -> dict[str, int]:
    """Max-min fair shares of `budget` tokens: smallest demands first, each gets at most an
    equal share of what is left (all of it when it asks less)."""
    shares: dict[str, int] = {}
    order = sorted(demands, key=demands.get)
    for i, client in enumerate(order):
        shares[client] = min(demands[client], budget // (len(order) - i))
        budget -= shares[client]
    return shares
