"""The seeds' batch-size negotiation, shared by HTTP (`X-Expected-Tokens`/`X-Max-Latency` ->
`X-Adopted-Batch-Size`/`X-Token-Quota`) and the protocol (`open.expected_tokens` /
`max_latency_ms` -> `accept.batch_size`/`token_quota`).

The rule (documented in docs/server.md):
- `batch_size` = the batch the request joins at admission: the engine's running requests plus
  this one, capped at `--max-batch-size`.
- `token_quota` = the most tokens the request may generate: its `max_tokens` (when absent,
  `expected_tokens`, else the rest of the context), never past the context
  (`max_model_len - prompt_tokens`), and, given `max_latency`, no more tokens than the engine
  produces in that time at its measured step interval (at least 1). The server enforces the
  quota as the request's `max_tokens`."""

from __future__ import annotations

import math

import msgspec


class LoadSnapshot(msgspec.Struct, frozen=True):
    """What the negotiation reads of the engine's state."""

    max_batch_size: int
    max_model_len: int
    num_running: int
    step_seconds: float
    """Recent mean seconds between engine steps (0 before any step)."""


class Adoption(msgspec.Struct, frozen=True):
    """The answer: `X-Adopted-Batch-Size` / `accept.batch_size` and `X-Token-Quota` /
    `accept.token_quota`."""

    batch_size: int
    token_quota: int


def negotiate(
    load: LoadSnapshot,
    *,
    prompt_tokens: int,
    max_tokens: int | None,
    expected_tokens: int | None = None,
    max_latency_s: float | None = None,
) -> Adoption:
    """Apply the rule of the module docstring."""
    room = max(1, load.max_model_len - prompt_tokens)
    wanted = max_tokens if max_tokens is not None else expected_tokens
    quota = room if wanted is None else min(wanted, room)
    if max_latency_s is not None and load.step_seconds > 0:
        quota = min(quota, max(1, math.floor(max_latency_s / load.step_seconds)))
    batch_size = max(1, min(load.max_batch_size, load.num_running + 1))
    return Adoption(batch_size=batch_size, token_quota=max(1, quota))
