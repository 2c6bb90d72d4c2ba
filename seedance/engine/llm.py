"""The offline API: `LLM(model, ...).generate(prompts, params)` runs the engine loop in the
caller's thread until every prompt is done and returns the results in prompt order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from seedance.engine.block_manager import BlockManager
from seedance.engine.config import ConfigError, EngineConfig
from seedance.engine.errors import invalid
from seedance.engine.llm_engine import LLMEngine
from seedance.engine.outputs import CompletionOutput, FinishReason, Usage
from seedance.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """A model loaded for offline generation (vLLM-style). Keyword arguments beyond the listed
    ones are any other `EngineConfig` field (e.g. `max_model_len`, `batch_window`,
    `trace_output`, `kv_cache_dtype`)."""

    def __init__(
        self,
        model: str,
        device: str = "cpu",
        dtype: str = "float32",
        attention_backend: str = "auto",
        block_size: int = 64,
        enable_prefix_caching: bool = True,
        max_batch_size: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_gb: float = 1.0,
        **config: Any,
    ) -> None:
        fields = dict(
            model=model,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            max_batch_size=max_batch_size,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_gb=kv_cache_gb,
            **config,
        )
        try:  # convert, unlike the constructor, checks the Literal fields (device, dtype, ...)
            self.config = msgspec.convert(fields, EngineConfig)
        except msgspec.ValidationError as exc:
            raise ConfigError(_field_of(str(exc)), str(exc)) from exc
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    @property
    def block_manager(self) -> BlockManager:
        """The engine's block accounting (tests assert every block is free after a run)."""
        return self.engine.block_manager

    @property
    def num_free_blocks(self) -> int:
        return self.engine.block_manager.free_block_count

    @property
    def num_total_blocks(self) -> int:
        return self.engine.block_manager.num_blocks

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priorities: Sequence[int] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt (strings or token-id lists) to completion; results in prompt order."""
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]  # one prompt
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        param_list = (
            [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        )
        if len(param_list) != len(prompt_list):
            raise invalid(
                "params", f"{len(param_list)} SamplingParams for {len(prompt_list)} prompts"
            )
        engine = self.engine
        ids: list[str] = []
        results: dict[str, dict[str, Any]] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, param_list, strict=True)):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                seq = engine.add_request(
                    request_id, prompt, p, priority=0 if priorities is None else priorities[i]
                )
                ids.append(request_id)
                results[request_id] = {
                    "prompt": list(seq.token_ids),
                    "tokens": [],
                    "text": [],
                    "logprobs": None,
                }
            while engine.has_unfinished_requests():
                for delta in engine.step().deltas:
                    r = results.get(delta.request_id)
                    if r is None:
                        continue
                    r["tokens"].extend(delta.token_ids)
                    r["text"].append(delta.text)
                    if delta.logprobs is not None:
                        r["logprobs"] = (r["logprobs"] or []) + delta.logprobs
                    if delta.finished:
                        r["reason"], r["usage"] = delta.finish_reason, delta.usage
        finally:
            for request_id in ids:
                engine.abort_request(request_id, notify=False)  # live ones, after an exception
        outputs = []
        for request_id in ids:
            r = results[request_id]
            reason: FinishReason = r["reason"]
            usage: Usage = r["usage"]
            outputs.append(
                CompletionOutput(
                    request_id=request_id,
                    prompt_token_ids=r["prompt"],
                    token_ids=r["tokens"],
                    text="".join(r["text"]),
                    finish_reason=reason,
                    usage=usage,
                    logprobs=r["logprobs"],
                )
            )
        return outputs

    def close(self) -> None:
        """Finish the trace file, if any."""
        self.engine.close()


def _field_of(message: str) -> str:
    """The config field a msgspec validation message is about."""
    if "$." in message:
        return message.rsplit("$.", 1)[-1].rstrip("`")
    if "`" in message:
        return message.split("`")[1]
    return message.split(":", 1)[0] if ":" in message else "config"
