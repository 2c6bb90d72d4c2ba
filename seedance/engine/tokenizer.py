"""The model's tokenizer as the engine uses it: encode plain and chat prompts, decode token
windows for the detokenizer, and the end-of-sequence ids."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from seedance.engine.errors import EngineError, invalid
from seedance.engine.request_checks import check_text

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class Tokenizer:
    """Wraps a Hugging Face fast tokenizer loaded from the model directory."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.hf: Any = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:
            raise EngineError(
                "unknown_model", f"cannot load the tokenizer from {path}: {exc}"
            ) from exc
        backend = getattr(self.hf, "backend_tokenizer", None) or getattr(
            self.hf, "_tokenizer", None
        )
        self._fast = backend
        self.bos_token_id: int | None = self.hf.bos_token_id
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        self.vocab_size = len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt, with the BOS token if the tokenizer adds one."""
        if not isinstance(text, str):
            raise invalid("prompt", "must be a string or a list of token ids")
        return list(self.hf.encode(check_text(text, "prompt"), add_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included."""
        return str(self.hf.decode([token_id], skip_special_tokens=False))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of `messages` under the chat template, generation prompt appended."""
        if not messages:
            raise invalid("messages", "must not be empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise invalid(f"messages[{i}].role", f"must be one of {sorted(CHAT_ROLES)}")
            if not isinstance(m.get("content"), str):
                raise invalid(f"messages[{i}].content", "must be a string")
            check_text(m["content"], f"messages[{i}].content")
        if not self.has_chat_template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
            return self.encode(text)
        ids = self.hf.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._fast is not None:
            return str(self._fast.decode(list(token_ids), skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))
