"""Batched sampling over requests with different parameters.

Per step: penalties from per-request token counts, logit_bias, suppression of EOS / stop ids before
`min_new_tokens`, the grammar bitmask, then greedy rows by argmax and the others by
temperature, top-k, top-p and min-p filtering, all as [batch, vocab] tensor ops. A request
with a seed samples from its own generator, so its output does not depend on the batch.
Logprobs are of the model's own distribution (raw logits).

Failures stay per row: a row whose logits are NaN or allow no token, whose grammar mask
or logprobs raise, or whose draw fails, gets an error message (the caller aborts that
request) and the other rows are sampled as usual. Temperatures below `MIN_TEMPERATURE` are
argmax (at 1e-5 the distribution already is), so a tiny temperature cannot overflow.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from spruce.runtime.core.request import Req, TokenLogprobs
from spruce.runtime.core.sampling_params import MIN_TEMPERATURE  # below: argmax (no overflow)
from spruce.runtime.executor.kernels import cpu_layer_ops

logger = logging.getLogger("spruce.sampler")
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
NO_TOKEN = "the logits allow no token (NaN, or every token masked)"  # a row's error


@dataclass(slots=True)
class SampleOutput:
    """Aligned with the rows: the chosen ids (None for a failed row), logprobs when asked,
    and the error message of each failed row."""

    ids: list[int | None]
    logprobs: list[TokenLogprobs | None]
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    def __init__(
        self, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device, seed: int = 0
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(i for i in eos_token_ids if i < vocab_size)
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, reqs: list[Req], apply_mask=None) -> SampleOutput:
        """logits [len(reqs), vocab] float32 (modified in place) -> next ids and logprobs.
        `apply_mask(logits, reqs)`, when given, masks constrained rows' disallowed tokens."""
        raw_logprobs = self._raw_logprobs(logits, reqs)
        self.process_logits(logits, reqs)
        errors: dict[int, str] = {}
        if apply_mask is not None:
            self._mask(apply_mask, logits, reqs, errors)
        ids: list[int | None] = self._choose(logits, reqs, errors)
        for i in errors:
            ids[i] = None
        return SampleOutput(ids, self._token_logprobs(raw_logprobs, ids, reqs, errors), errors)

    def process_logits(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """In place: penalties, logit_bias, and EOS / stop ids suppressed before min_new_tokens."""
        self._apply_penalties(logits, reqs)
        self._apply_logit_bias(logits, reqs)
        self._suppress_stops(logits, reqs)
        return logits

    def release(self, rid: str) -> None:
        self._request_generators.pop(rid, None)

    # -- logits processing ------------------------------------------------------------

    def _raw_logprobs(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor | None:
        rows = [i for i, r in enumerate(reqs) if r.options.return_logprob]
        if not rows:
            return None
        return torch.log_softmax(logits[rows], dim=-1)

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        rows = [i for i, r in enumerate(reqs) if r.sampling.has_penalties]
        if not rows:
            return
        counts = self._output_counts([reqs[i] for i in rows])
        params = [reqs[i].sampling for i in rows]
        sub = logits[rows]
        freq = self._column([p.frequency_penalty for p in params])
        presence = self._column([p.presence_penalty for p in params])
        sub -= freq * counts + presence * (counts > 0)
        rep = self._column([p.repetition_penalty for p in params])
        seen = self._seen_anywhere([reqs[i] for i in rows])
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        logits[rows] = torch.where(seen, penalized, sub)

    def _apply_logit_bias(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        """OpenAI's logit_bias: each (token, bias) of a row added to its logit, the bias
        clipped to [-100, 100]; one scatter for the rows that have a bias, nothing otherwise."""
        rows, cols, values = [], [], []
        for i, r in enumerate(reqs):
            for token, bias in r.sampling.logit_bias:
                rows.append(i)
                cols.append(token)
                values.append(min(max(float(bias), -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS))
        if not rows:
            return
        index = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
        logits.index_put_(
            index, torch.tensor(values, dtype=logits.dtype, device=self.device), accumulate=True
        )

    def _output_counts(self, reqs: list[Req]) -> torch.Tensor:
        counts = torch.zeros(len(reqs), self.vocab_size, device=self.device)
        for i, r in enumerate(reqs):
            if r.output_ids:
                ids = torch.tensor(r.output_ids, device=self.device)
                counts[i].index_add_(0, ids, torch.ones(len(r.output_ids), device=self.device))
        return counts

    def _seen_anywhere(self, reqs: list[Req]) -> torch.Tensor:
        """Tokens in prompt or output (repetition_penalty covers both, as in transformers)."""
        seen = torch.zeros(len(reqs), self.vocab_size, dtype=torch.bool, device=self.device)
        for i, r in enumerate(reqs):
            seen[i, torch.tensor(r.all_ids(), device=self.device)] = True
        return seen

    def _suppress_stops(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        for i, r in enumerate(reqs):
            if len(r.output_ids) < r.sampling.min_new_tokens:
                ids = [
                    *self.eos_token_ids,
                    *(t for t in r.sampling.stop_token_ids if t < self.vocab_size),
                ]
                logits[i, ids] = float("-inf")

    def _mask(
        self, apply_mask, logits: torch.Tensor, reqs: list[Req], errors: dict[int, str]
    ) -> None:
        """The grammar masks of the batch; if that raises, each constrained row alone."""
        try:
            apply_mask(logits, reqs)
            return
        except Exception:  # one request's cursor, presumably: find which below
            logger.exception("the batch's grammar mask failed; masking row by row")
        for i, req in enumerate(reqs):
            if req.cursor is None:
                continue
            try:
                apply_mask(logits[i : i + 1], [req])
            except Exception:
                logger.exception("the grammar mask of request %s failed", req.rid)
                errors[i] = "the grammar mask failed (see the server log)"

    @staticmethod
    def argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's argmax (argmax picks a NaN when there is one) and its logit: one C pass
        over float32 CPU logits (cpu_layer_ops.argmax_rows), torch elsewhere."""
        if logits.dim() == 2 and cpu_layer_ops.usable(logits):
            return cpu_layer_ops.argmax_rows(logits)
        ids = logits.argmax(dim=-1)
        return ids, logits.gather(1, ids[:, None])[:, 0]

    def _check_rows(self, best: torch.Tensor, errors: dict[int, str]) -> None:
        """Rows with a NaN or +inf, or with every token at -inf, cannot be sampled: exactly
        those whose argmax logit (`best`) is not finite, so this costs no other pass over the
        vocabulary."""
        for i, value in enumerate(best.tolist()):
            if not math.isfinite(value):
                errors.setdefault(i, NO_TOKEN)

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)[:, None]

    # -- choosing tokens -----------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, reqs: list[Req], errors: dict[int, str]) -> list[int]:
        ids, best = self.argmax(logits)
        self._check_rows(best, errors)
        sampled = [i for i, r in enumerate(reqs) if _is_sampled(r) and i not in errors]
        if sampled:
            probs = self._filtered_probs(logits[sampled], [reqs[i].sampling for i in sampled])
            ids[sampled] = self._draw(probs, [reqs[i] for i in sampled], sampled, errors)
        return ids.tolist()

    def _filtered_probs(self, logits: torch.Tensor, params) -> torch.Tensor:
        # the row maximum first: (logits - max) / temperature never overflows to NaN
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(shifted / self._column([p.temperature for p in params]), dim=-1)
        if all(p.top_k == -1 and p.top_p == 1.0 and p.min_p == 0.0 for p in params):
            return probs
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=self.device)[None, :]
        top_k = torch.tensor(
            [p.top_k if p.top_k > 0 else probs.shape[-1] for p in params], device=self.device
        )
        drop = rank >= top_k[:, None]
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) > self._column([p.top_p for p in params])
        drop |= sorted_probs < self._column([p.min_p for p in params]) * sorted_probs[:, :1]
        drop[:, 0] = False  # the most likely token always stays
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)

    def _draw(
        self, probs: torch.Tensor, reqs: list[Req], rows: list[int], errors: dict[int, str]
    ) -> torch.Tensor:
        """Draws one id per row of `probs` (rows[j]: its batch row, for errors)."""
        out = torch.zeros(len(reqs), dtype=torch.int64, device=self.device)
        shared = [j for j, r in enumerate(reqs) if r.sampling.seed is None]
        if shared:
            try:
                out[shared] = torch.multinomial(probs[shared], 1, generator=self.generator)[:, 0]
            except RuntimeError:  # checked rows cannot fail here; should one, find it alone
                logger.exception("batched sampling failed; drawing row by row")
                self._draw_each(
                    probs,
                    reqs,
                    [rows[j] for j in shared],
                    errors,
                    out,
                    shared,
                    shared_generator=True,
                )
        seeded = [j for j, r in enumerate(reqs) if r.sampling.seed is not None]
        self._draw_each(probs, reqs, [rows[j] for j in seeded], errors, out, seeded)
        return out

    def _draw_each(
        self, probs, reqs, batch_rows, errors, out, which, shared_generator=False
    ) -> None:
        """Draws rows `which` of `probs` one at a time; a failure is its row's error."""
        for j, batch_row in zip(which, batch_rows):
            try:
                gen = self.generator if shared_generator else self._generator_of(reqs[j])
                out[j] = torch.multinomial(probs[j], 1, generator=gen)[0]
            except Exception:
                logger.exception("sampling request %s failed", reqs[j].rid)
                errors[batch_row] = "sampling failed (see the server log)"

    def _generator_of(self, req: Req) -> torch.Generator:
        gen = self._request_generators.get(req.rid)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(req.sampling.seed)
            self._request_generators[req.rid] = gen
        return gen

    # -- logprobs -----------------------------------------------------------------------

    def _token_logprobs(
        self, raw: torch.Tensor | None, ids: list[int | None], reqs: list[Req], errors
    ):
        out: list[TokenLogprobs | None] = [None] * len(reqs)
        if raw is None:
            return out
        rows = [i for i, r in enumerate(reqs) if r.options.return_logprob]
        for j, i in enumerate(rows):
            if i in errors:
                continue
            try:
                out[i] = TokenLogprobs(
                    float(raw[j, ids[i]]), top_logprobs(raw[j], reqs[i].options.top_logprobs_num)
                )
            except Exception:
                logger.exception("the logprobs of request %s failed", reqs[i].rid)
                errors[i] = "computing logprobs failed (see the server log)"
        return out


def plain_argmax(req: Req) -> bool:
    """Whether the sampler picks this request's tokens by argmax over its raw logits, with
    nothing else computed: greedy, no penalties, logit_bias or logprobs, no grammar, and
    min_new_tokens reached (so it can decode several steps in one call: engine/core.py)."""
    s = req.sampling
    if _is_sampled(req) or s.has_penalties or s.logit_bias or req.cursor is not None:
        return False
    return not req.options.return_logprob and len(req.output_ids) >= s.min_new_tokens


def _is_sampled(req: Req) -> bool:
    """Not argmax: a positive temperature (at least MIN_TEMPERATURE) and top_k != 1."""
    return not req.sampling.is_greedy and req.sampling.temperature >= MIN_TEMPERATURE


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    if k <= 0:
        return []
    values, ids = logprobs.topk(min(k, logprobs.numel()))
    return list(zip(values.tolist(), ids.tolist()))


def prompt_logprobs(
    req: Req, logits: torch.Tensor, first_pos: int
) -> list[tuple[float | None, int, list]]:
    """Logprobs of prompt tokens predicted by `logits` (rows = positions first_pos.. of
    this step): the row at position p scores prompt token p + 1. Only tokens at or after
    the request's `logprob_start_len` are returned; the very first token has no logprob."""
    start = req.prompt_logprob_start
    n_prompt = len(req.prompt_ids)
    out: list[tuple[float | None, int, list]] = []
    if start == 0 and first_pos == 0:
        out.append((None, req.prompt_ids[0], []))
    lo = max(first_pos, start - 1, 0)  # first scoring row (position)
    hi = min(
        first_pos + logits.shape[0], n_prompt - 1
    )  # rows up to the last prompt token's predictor
    if hi <= lo:
        return out
    logprobs = torch.log_softmax(logits[lo - first_pos : hi - first_pos], dim=-1)
    targets = torch.tensor(req.prompt_ids[lo + 1 : hi + 1], device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    for j, (lp, tok) in enumerate(zip(chosen, targets.tolist())):
        out.append((lp, tok, top_logprobs(logprobs[j], req.options.top_logprobs_num)))
    return out
