"""Logits rows -> samples: greedy, temperature, top-k, top-p, per-request seeds, beam candidates.

Vectorised over the batch: one log-softmax, one sort for the rows that use top-k/top-p, one exponential-race
draw (argmax of probs / Exp(1) noise is a draw from probs). Seeded rows draw their noise on the CPU from their
own torch.Generator, so a seed gives the same samples on any backend, device and batch composition.
Reported log-probabilities are the model's (log-softmax of the raw logits, before penalties, temperature and
filtering, as vLLM reports them by default). Rows whose request asks for logprobs also get their top candidates;
rows with presence, frequency or repetition penalties have their logits penalized from the sequence's tokens.
Neither costs anything when no row asks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvlab.common.request import SampleSpec

Sample = tuple[int, float] | tuple[int, float, tuple[tuple[int, float], ...]]   # (token, logprob[, top])


class History(Protocol):
    """What penalties read of a sequence: its tokens, the first prompt_len of them the prompt."""
    token_ids: list[int]
    prompt_len: int


def apply_penalties(logits: torch.Tensor, rows: list[int], specs: list[SampleSpec], histories: list[History]
                    ) -> torch.Tensor:
    """vLLM's definitions: repetition divides a positive logit (multiplies a negative one) of every token seen in
    the prompt or output; frequency subtracts once per output occurrence; presence once per token generated."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    for row in rows:
        p, h = specs[row].params, histories[row]
        output = torch.tensor(h.token_ids[h.prompt_len:], dtype=torch.int64, device=logits.device)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
        if p.repetition_penalty != 1:
            seen = counts > 0
            seen[torch.tensor(h.token_ids[:h.prompt_len], dtype=torch.int64, device=logits.device)] = True
            x = logits[row]
            logits[row] = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty,
                                                        x * p.repetition_penalty), x)
        logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
                      ) -> torch.Tensor:
    """Mask (to -inf) what top-k ([R] int64, vocab size = off) and top-p ([R] float, 1 = off) exclude."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False                   # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, specs: list[SampleSpec], histories: list[History] | None = None
                 ) -> list[list[Sample]]:
        """logits [R, V] (one row per spec) -> per row the requested samples as (token, logprob), and their
        top candidates (token, logprob, top) for rows asking for logprobs. `histories` (one per row) are needed
        when a row has penalties."""
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        penalized = [row for row, spec in enumerate(specs) if spec.params.penalized]
        if penalized:
            logits = apply_penalties(logits, penalized, specs, histories)
        results: list[list[Sample] | None] = [None] * len(specs)
        greedy, random, beams = [], [], []
        for row, spec in enumerate(specs):
            (beams if spec.beam else greedy if spec.params.greedy else random).append(row)
        if greedy:
            self._greedy(logits, logprobs, specs, greedy, results)
        if beams:
            self._beams(logprobs, specs, beams, results)
        if random:
            self._random(logits, logprobs, specs, random, results)
        asking = [row for row, spec in enumerate(specs) if spec.params.logprobs is not None]
        if asking:
            self._add_top(logprobs, specs, asking, results)
        return results

    @staticmethod
    def _add_top(logprobs, specs, rows, results) -> None:
        """Each sample of the rows asking for logprobs gets its row's `params.logprobs` best candidates."""
        k = max(specs[r].params.logprobs for r in rows)
        values, tokens = logprobs[torch.tensor(rows, device=logprobs.device)].topk(k, dim=-1)
        for i, row in enumerate(rows):
            n = specs[row].params.logprobs
            top = tuple(zip(tokens[i, :n].tolist(), values[i, :n].tolist()))
            results[row] = [(tok, lp, top) for tok, lp in results[row]]

    @staticmethod
    def _greedy(logits, logprobs, specs, rows, results) -> None:
        index = torch.tensor(rows, device=logits.device)
        tokens = logits.index_select(0, index).argmax(dim=-1)
        lps = logprobs.index_select(0, index).gather(1, tokens.unsqueeze(1)).squeeze(1)
        for row, tok, lp in zip(rows, tokens.tolist(), lps.tolist()):
            results[row] = [(tok, lp)] * specs[row].num_samples

    @staticmethod
    def _beams(logprobs, specs, rows, results) -> None:
        k = min(max(specs[r].num_samples for r in rows), logprobs.shape[-1])
        index = torch.tensor(rows, device=logprobs.device)
        values, tokens = logprobs.index_select(0, index).topk(k, dim=-1)
        for i, row in enumerate(rows):
            n = min(specs[row].num_samples, k)
            results[row] = list(zip(tokens[i, :n].tolist(), values[i, :n].tolist()))

    def _random(self, logits, logprobs, specs, rows, results) -> None:
        expanded = [r for r in rows for _ in range(specs[r].num_samples)]
        device = logits.device
        index = torch.tensor(expanded, device=device)
        params = [specs[r].params for r in expanded]
        temps = torch.tensor([p.temperature for p in params], device=device)
        scaled = logits.index_select(0, index) / temps.unsqueeze(1)
        top_k = top_p = None
        vocab = logits.shape[-1]
        if any(p.top_k != -1 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k != -1 else vocab for p in params], device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device)
        if top_k is not None or top_p is not None:
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = self._noise(probs, specs, rows)
        tokens = (probs / noise).argmax(dim=-1)
        lps = logprobs.index_select(0, index).gather(1, tokens.unsqueeze(1)).squeeze(1)
        tokens, lps = tokens.tolist(), lps.tolist()
        pos = 0
        for r in rows:
            n = specs[r].num_samples
            results[r] = list(zip(tokens[pos:pos + n], lps[pos:pos + n]))
            pos += n

    def _noise(self, probs: torch.Tensor, specs, rows) -> torch.Tensor:
        """Exp(1) noise per expanded row: the sampler's generator, or the row's own seeded CPU generator."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        pos = 0
        for r in rows:
            gens = specs[r].generators
            n = specs[r].num_samples
            if gens is not None:
                for j in range(n):
                    row = torch.empty(probs.shape[-1]).exponential_(generator=gens[j])
                    noise[pos + j].copy_(row)
            pos += n
        return noise.clamp_(min=1e-30)      # a zero draw would turn a masked 0/0 into NaN
