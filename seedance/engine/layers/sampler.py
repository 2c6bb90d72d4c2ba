"""Turns the last-position logits of a batch into next tokens: penalties, greedy or temperature
sampling with top-k/top-p/min-p, per-request seeds, optional top-n logprobs.

Sampling draws exponential noise per row (argmax(p / q), q ~ Exp(1), is a draw from p), so a
seeded request draws only from its own generator: its tokens do not depend on its batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seedance.engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs about one sequence."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        logits = logits.float()
        n = len(rows)
        want_logprobs = [r.params.logprobs for r in rows]
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(w is not None for w in want_logprobs) else None
        )
        for i, row in enumerate(rows):
            p = row.params
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                logits[i] = apply_penalties(logits[i], row)

        greedy = [r.params.greedy for r in rows]
        tokens = logits.argmax(dim=-1) if all(greedy) else self._sample(logits, rows, greedy)
        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * n
        if raw_logprobs is not None:
            for i, top_n in enumerate(want_logprobs):
                if top_n is not None:
                    logprobs[i] = top_logprobs(raw_logprobs[i], token_list[i], top_n)
        return SamplerOutput(token_list, logprobs)

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]
    ) -> torch.Tensor:
        temps = torch.tensor(
            [1.0 if g else r.params.temperature for r, g in zip(rows, greedy, strict=True)]
        )
        scaled = logits / temps.unsqueeze(1)
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = _top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        if any(m > 0.0 for m in min_p):
            mp = torch.tensor(min_p).unsqueeze(1)
            cutoff = probs.max(dim=-1, keepdim=True).values * mp
            probs = probs.masked_fill(probs < cutoff, 0.0)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(
                generator=self.generator
            )
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            g = torch.tensor(greedy)
            sampled = torch.where(g, logits.argmax(dim=-1), sampled)
        return sampled


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (divide positive logits, multiply
    negative ones); presence and frequency penalties over output tokens (OpenAI semantics)."""
    p = row.params
    vocab = logits.shape[0]
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in row.token_ids if t < vocab}), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if p.presence_penalty or p.frequency_penalty:
        out = [t for t in row.token_ids[row.num_prompt_tokens :] if t < vocab]
        if out:
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab).float()
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) every logit outside each row's top-k and top-p nucleus."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([vocab if kk <= 0 else min(kk, vocab) for kk in top_k])
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    p = torch.tensor(top_p).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # mass strictly above each rank
    drop |= cum_before >= p
    drop[:, 0] = False  # always keep the best token
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, masked)


def top_logprobs(logprobs: torch.Tensor, chosen: int, top_n: int) -> dict[int, float]:
    """The chosen token's logprob and the `top_n` most likely tokens'."""
    out = {chosen: float(logprobs[chosen])}
    if top_n > 0:
        values, ids = logprobs.topk(top_n)
        for v, t in zip(values.tolist(), ids.tolist(), strict=True):
            out.setdefault(int(t), float(v))
    return out
