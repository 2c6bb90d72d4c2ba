"""The null step core: the real engine with its model step replaced by instant deterministic
tokens. Requests go through the real `Scheduler`, `BlockManager` (a simulated cache of
`kv_cache_gb * BLOCKS_PER_GIB` blocks), `Sequence` and `IncrementalDetokenizer`, so batching,
preemption, pause/resume, prefix caching and stop handling are the real ones.

Output: a fixed English text read from an offset that depends only on the prompt (greedy) or
on the prompt and seed (sampled), so the same request always yields the same text; with
`eos_after`, EOS is the n-th generated token unless `ignore_eos`."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Sequence as Seq

from seedance.engine.block_manager import BlockManager
from seedance.engine.byte_tokenizer import EOS_ID, VOCAB_SIZE, ByteTokenizer
from seedance.engine.config import EngineConfig
from seedance.engine.engine_core import EngineCore
from seedance.engine.outputs import RequestDelta, StepOutput
from seedance.engine.sampling_params import SamplingParams
from seedance.engine.scheduler import SchedulerOutput
from seedance.engine.sequence import Sequence
from seedance.engine.tracing import TraceWriter

DEFAULT_MAX_MODEL_LEN = 4096
BLOCKS_PER_GIB = 16384
"""Simulated KV blocks per GiB of --kv-cache-gb (blocks cost nothing until first used)."""
OUTPUT_TEXT = (
    b"Seedance streams every token the moment it is sampled. The engine batches sequences "
    b"continuously, the protocol acknowledges each frame, and the server never buffers without "
    b"bound. Credit pauses a stream; a resumed session loses nothing and repeats nothing. "
)
assert OUTPUT_TEXT.isascii()
_CHAR = [chr(b) for b in range(128)]
"""The text of each ASCII byte token: a token of a request without stop strings needs no
incremental decoding (every output token is one whole character)."""


class NullSequence(Sequence):
    """A sequence with where its text starts and how long it may take the steady path."""

    offset: int = 0
    """Position in OUTPUT_TEXT of its first output token."""
    steady_end: int = 0
    """Output indices in [1, steady_end) are plain tokens: no stop string or stop token can
    end them, no logprobs, not the last by length, not EOS (see `NullCore._sample`)."""


class NullCore(EngineCore):
    """A step core whose "model" emits OUTPUT_TEXT; see the module docstring."""

    def __init__(self, config: EngineConfig, *, eos_after: int | None = None) -> None:
        self.tokenizer: ByteTokenizer = ByteTokenizer()
        self.eos_token_ids = frozenset({EOS_ID})
        self.vocab_size = VOCAB_SIZE
        num_blocks = max(1, int(config.kv_cache_gb * BLOCKS_PER_GIB))
        self.max_model_len = min(
            config.max_model_len or DEFAULT_MAX_MODEL_LEN, num_blocks * config.block_size
        )
        self._init_core(
            config, BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        )
        self._eos_after = eos_after
        self.plain_shortcut = True
        """Emit plain tokens (NullSequence.steady_end) without the detokenizer; tests turn it
        off to compare against the general emission."""
        self._unseeded = itertools.count()
        self.tracer = TraceWriter(config.trace_output) if config.trace_output else None

    def _new_sequence(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        priority: int,
        deadline: float | None,
        arrival_time: float,
    ) -> Sequence:
        seq = NullSequence(
            request_id,
            prompt_ids,
            params,
            priority=priority,
            deadline=deadline,
            arrival_time=arrival_time,
            detokenizer=self._detokenizer(prompt_ids, params),
            eos_token_ids=self.eos_token_ids,
        )
        seed = params.seed
        if not params.greedy and seed is None:
            seed = self.config.seed + next(self._unseeded) + 1
        seq.offset = output_offset(prompt_ids, None if params.greedy else seed)
        if (
            self.plain_shortcut
            and not params.stop
            and not params.stop_token_ids
            and params.logprobs is None
        ):
            end = min(params.max_tokens, self.max_model_len - len(prompt_ids)) - 1
            if self._eos_after is not None and not params.ignore_eos:
                end = min(end, self._eos_after - 1)
            seq.steady_end = end
        return seq

    def step(self) -> StepOutput:
        start = time.monotonic()
        self.step_count += 1
        batch = self.scheduler.schedule(start)
        deltas = self._begin_step()
        if batch.seqs:
            self._run(batch, deltas, start)
        now = time.monotonic()
        if self.tracer is not None:
            self._trace(start, now, batch, deltas)  # pending finals carry no tokens
        return self._end_step(self.step_count, deltas, now)

    def _run(self, batch: SchedulerOutput, deltas: list[RequestDelta], now: float) -> None:
        """The "forward pass": every scheduled sequence computes its new tokens; those that
        reach their end sample one."""
        if batch.steady:
            self._run_steady(batch.seqs, deltas, now)
            return
        commit = self.block_manager.commit
        block_size = self.block_manager.block_size
        text, text_len, chars = OUTPUT_TEXT, len(OUTPUT_TEXT), _CHAR
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            if n > 1 or seq.num_computed_tokens % block_size == 0:
                commit(seq)  # a block may have filled up: register it in the prefix cache
            pos = len(seq.token_ids)
            if seq.num_computed_tokens != pos:
                continue
            index = pos - seq.num_prompt_tokens
            if 0 < index < seq.steady_end:  # type: ignore[attr-defined]
                token = text[(seq.offset + index) % text_len]  # type: ignore[attr-defined]
                seq.token_ids.append(token)
                seq.num_emitted_tokens = index + 1
                deltas.append(RequestDelta(seq.request_id, index, [token], chars[token]))
                self.generation_tokens_total += 1
            else:
                self._sample_and_emit(seq, pos, deltas, now)

    def _run_steady(self, seqs: list[Sequence], deltas: list[RequestDelta], now: float) -> None:
        """A steady decode step (see SchedulerOutput.steady): each sequence computes its last
        token and samples. A steady token (NullSequence.steady_end) makes the delta
        `_accept_token` would make, without the detokenizer and the stop checks."""
        bm = self.block_manager
        block_size = bm.block_size
        caching = bm.enable_prefix_caching
        text, text_len, chars = OUTPUT_TEXT, len(OUTPUT_TEXT), _CHAR
        append = deltas.append
        general = 0
        for seq in seqs:
            computed = seq.num_computed_tokens + 1
            seq.num_computed_tokens = computed
            if caching and computed % block_size == 0:
                bm.commit(seq)  # its last block filled up: register it in the prefix cache
            index = computed - seq.num_prompt_tokens
            if 0 < index < seq.steady_end:  # type: ignore[attr-defined]
                token = text[(seq.offset + index) % text_len]  # type: ignore[attr-defined]
                seq.token_ids.append(token)
                seq.num_emitted_tokens = index + 1
                append(RequestDelta(seq.request_id, index, [token], chars[token]))
            else:
                general += 1
                self._sample_and_emit(seq, computed, deltas, now)
        self.generation_tokens_total += len(seqs) - general

    def _sample_and_emit(
        self, seq: Sequence, pos: int, deltas: list[RequestDelta], now: float
    ) -> None:
        token = self._sample(seq, pos - seq.num_prompt_tokens)
        seq.token_ids.append(token)
        top = seq.params.logprobs
        logprobs = None if top is None else _logprobs(token, top)
        deltas.append(self._emit_token(seq, pos, token, logprobs, now))

    def _sample(self, seq: Sequence, index: int) -> int:
        """The output token at `index`: EOS at `eos_after`, else the next byte of the text."""
        if (
            self._eos_after is not None
            and index + 1 >= self._eos_after
            and not seq.params.ignore_eos
        ):
            return EOS_ID
        assert isinstance(seq, NullSequence)
        return OUTPUT_TEXT[(seq.offset + index) % len(OUTPUT_TEXT)]

    def _trace(
        self, start: float, now: float, batch: SchedulerOutput, deltas: list[RequestDelta]
    ) -> None:
        assert self.tracer is not None
        tokens = sum(len(d.token_ids) for d in deltas)
        self.tracer.step(self.step_count, start, {"sample": now - start}, len(batch.seqs), tokens)
        for delta in deltas:
            for i, token in enumerate(delta.token_ids):
                self.tracer.token(
                    delta.request_id, now, delta.index + i, token, [], self.step_count, {}
                )

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()
            self.tracer = None


def output_offset(prompt_ids: Seq[int], seed: int | None) -> int:
    """Where in OUTPUT_TEXT a request's text starts: a hash of its prompt (and seed)."""
    digest = hashlib.blake2b(bytes(str((list(prompt_ids), seed)), "ascii"), digest_size=8)
    return int.from_bytes(digest.digest(), "big") % len(OUTPUT_TEXT)


def _logprobs(token: int, top: int) -> dict[int, float]:
    """The chosen token at logprob 0; `top` neighbouring byte tokens at -1, -2, ..."""
    entry = {token: 0.0}
    for k in range(1, top + 1):
        entry.setdefault((token + k) % 256, -float(k))
    return entry
