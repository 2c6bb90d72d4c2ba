"""The null engine's tokenizer: byte level (token id = byte value, plus BOS/EOS/PAD specials)
with a plain chat template, so that it needs no model files."""

from __future__ import annotations

from collections.abc import Sequence

from seedance.engine.errors import EngineError
from seedance.engine.request_checks import check_text

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_SPECIAL_TEXT = {BOS_ID: b"<s>", EOS_ID: b"</s>", PAD_ID: b"<pad>"}


class ByteTokenizer:
    """Bytes in, bytes out: token id = byte value; 256 = BOS, 257 = EOS, 258 = PAD."""

    eos_token_id = EOS_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise EngineError(
                "invalid_request", "prompt: must be a string or a list of token ids", "prompt"
            )
        try:
            data = text.encode()
        except UnicodeEncodeError:
            data = check_text(text, "prompt").encode()  # check_text raises, naming the index
        return [BOS_ID, *data]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for token in token_ids:
            if token < 256:
                out.append(token)
            elif not skip_special_tokens:
                out += _SPECIAL_TEXT[token]
        return out.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included."""
        return self.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        """`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` (the generation prompt)."""
        if not messages:
            raise EngineError("invalid_request", "messages: must not be empty", param="messages")
        parts: list[str] = []
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            content = message.get("content") if isinstance(message, dict) else None
            if role not in CHAT_ROLES:
                raise EngineError(
                    "invalid_request",
                    f"messages[{i}].role: must be one of {sorted(CHAT_ROLES)}",
                    param="messages",
                )
            if not isinstance(content, str):
                raise EngineError(
                    "invalid_request", f"messages[{i}].content: must be a string", param="messages"
                )
            check_text(content, f"messages[{i}].content")
            parts.append(f"<|{role}|>\n{content}\n")
        parts.append("<|assistant|>\n")
        return "".join(parts)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(self.render_chat(messages))
