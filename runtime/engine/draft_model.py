"""A draft model for speculative decoding (--speculative-algorithm draft): a smaller model
that shares the target's tokenizer proposes k tokens greedily for each drafting request,
all requests of a step batched in each of its k forward passes.

The draft model has its own model runner, KV pool and request rows, sized like the
target's. Per request it remembers which tokens its K/V hold (`_Drafting.ids`, a row of
its table); before drafting, the longest prefix those share with the request's tokens is
kept and the rest is computed in one extend pass (the whole prompt the first time), whose
last logits give the first draft token; each further token is a decode pass. Drafts are
the draft model's argmax: a proposal that puts all its probability on one token, for which
the standard accept / resample rule is exactly verify.py's (accept with the target's
probability of the token, else a token from the target's distribution without it).

A request's draft state goes when it leaves the running set (finished, aborted or
retracted: `forget`); a request the draft pool has no room for does not draft that step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from spruce.radix.radix_cache import common_prefix_len
from spruce.runtime.core.request import Req
from spruce.runtime.errors import SpruceError
from spruce.runtime.executor.kv_pool import OutOfSlotsError
from spruce.runtime.executor.model_runner import ForwardItem, ModelRunner
from spruce.runtime.models.loading.loader import LoadedModel

logger = logging.getLogger("spruce")


@dataclass(slots=True)
class _Drafting:
    row: int
    ids: list[int] = field(default_factory=list)  # tokens whose K/V the row holds, in order


class DraftModelDrafter:
    def __init__(self, loaded: LoadedModel, target: LoadedModel, runner_options: dict) -> None:
        check_same_tokenizer(loaded, target)
        self.loaded = loaded
        self.runner = ModelRunner(loaded, **runner_options)
        self.allocator = self.runner.pool.allocator
        self.table = self.runner.req_to_token
        self.state: dict[str, _Drafting] = {}

    # -- the drafter interface ----------------------------------------------------------------

    @torch.inference_mode()
    def propose_many(self, reqs: list[Req], lengths: list[int]) -> list[list[int]]:
        """Up to lengths[i] greedy draft tokens for each request (fewer, or none, when the
        draft pool runs short)."""
        ready = [(req, n) for req, n in zip(reqs, lengths) if n > 0 and self._catch_up_room(req, n)]
        drafts = {id(req): [] for req, _ in ready}
        items = [self._catch_up_item(req) for req, _ in ready]
        while items:
            logits = self.runner.forward(items).logits
            tokens = logits.argmax(dim=-1).tolist()
            items = []
            for (req, n), token in zip(ready, tokens):
                drafts[id(req)].append(token)
                if len(drafts[id(req)]) < n:
                    items.append(self._decode_item(req, token))
            ready = [(req, n) for req, n in ready if len(drafts[id(req)]) < n]
        return [drafts.get(id(req), []) for req in reqs]

    def forget(self, req: Req) -> None:
        """Frees the request's draft row and slots (it left the running set)."""
        state = self.state.pop(req.rid, None)
        if state is not None:
            self.allocator.free(self.table.read(state.row, len(state.ids)))
            self.table.free_row(state.row)

    @property
    def held_slots(self) -> int:
        return sum(len(s.ids) for s in self.state.values())

    def check_integrity(self) -> None:
        """Debug check: the draft pool's used slots are exactly those the rows hold."""
        self.allocator.check_integrity(held=self.held_slots)

    # -- steps -------------------------------------------------------------------------------

    def _catch_up_room(self, req: Req, n: int) -> bool:
        """Keeps the prefix the row shares with the request's tokens and makes room for the
        rest and the drafts; False (state dropped) when the pool or the rows are full."""
        state = self.state.get(req.rid)
        if state is None:
            try:
                state = self.state[req.rid] = _Drafting(self.table.alloc_row())
            except OutOfSlotsError:
                return False
        tokens = req.all_ids()
        keep = min(
            common_prefix_len(state.ids, tokens, 0), len(tokens) - 1
        )  # the last token's logits
        self.allocator.free(self.table.read(state.row, len(state.ids), keep))
        del state.ids[keep:]
        if self.allocator.num_free < len(tokens) - keep + n:
            self.forget(req)
            return False
        return True

    def _catch_up_item(self, req: Req) -> ForwardItem:
        state = self.state[req.rid]
        new = req.all_ids()[len(state.ids) :]
        return self._item(state, new)

    def _decode_item(self, req: Req, token: int) -> ForwardItem:
        return self._item(self.state[req.rid], [token])

    def _item(self, state: _Drafting, new: list[int]) -> ForwardItem:
        slots = self.allocator.alloc(len(new))
        item = ForwardItem(state.row, len(state.ids), new, slots)
        state.ids.extend(new)
        return item


def check_same_tokenizer(draft: LoadedModel, target: LoadedModel) -> None:
    """A draft model must number tokens as the target does: the same vocabulary (added and
    special tokens included) and the same size of the output layer."""
    a, b = draft.tokenizer, target.tokenizer
    same = a.backend.get_vocab(with_added_tokens=True) == b.backend.get_vocab(
        with_added_tokens=True
    )
    if not same or draft.config.vocab_size != target.config.vocab_size:
        raise SpruceError(
            f"the draft model {draft.name!r} has another tokenizer than the target {target.name!r}: "
            "speculative decoding needs a draft model with the target's vocabulary"
        )
