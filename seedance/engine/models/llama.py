"""The decoder-only transformer of Llama 2/3, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm), reading
and writing the paged KV cache through an attention backend. Parameter names follow the Hugging
Face checkpoints, except q/k/v and gate/up which are fused at load time."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from seedance.engine.attention.backend import AttentionBackend
from seedance.engine.attention.metadata import AttentionMetadata
from seedance.engine.errors import EngineError
from seedance.engine.layers.linear import Linear
from seedance.engine.layers.norm import RMSNorm
from seedance.engine.layers.rotary import RotaryEmbedding
from seedance.engine.model_config import ModelConfig

FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
"""Checkpoint projection -> (our fused projection, shard index)."""


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.shard_sizes = (self.q_size, self.kv_size, self.kv_size)
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.shard_sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)
        projected: torch.Tensor = self.o_proj(out.reshape(n, self.q_size))
        return projected


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.shard_sizes = (cfg.intermediate_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.shard_sizes, dim=-1)
        down: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return down


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary, backend)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h), meta)
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(h))
        return h + mlp_out


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.rotary = rotary
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, rotary, backend) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h, meta)
        normed: torch.Tensor = self.norm(h)
        return normed


class LlamaForCausalLM(nn.Module):
    """`forward` maps a step's packed tokens to hidden states; `compute_logits` maps the rows
    that sample to vocabulary logits."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, backend)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, positions, meta)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]  # type: ignore[misc]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the parameters, fusing q/k/v and gate/up; every
        parameter must be covered (a tied lm_head may be absent)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for ckpt, (fused, idx) in FUSED.items():
                if f".{ckpt}." in name:
                    target, shard = name.replace(f".{ckpt}.", f".{fused}."), idx
                    break
            param = params.get(target)
            if param is None:
                raise EngineError("unknown_model", f"unexpected tensor {name!r} in the checkpoint")
            if shard is None:
                if param.shape != tensor.shape:
                    raise EngineError(
                        "unknown_model",
                        f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}",
                    )
                param.copy_(tensor)
                loaded.add(target)
            else:
                sizes = _shard_sizes(self, target)
                start = sum(sizes[:shard])
                part = param.narrow(0, start, sizes[shard])
                if part.shape != tensor.shape:
                    raise EngineError(
                        "unknown_model",
                        f"{name}: shape {tuple(tensor.shape)}, expected {tuple(part.shape)}",
                    )
                part.copy_(tensor)
                loaded.add(f"{target}#{shard}")
        expected: set[str] = set()
        for pname in params:
            if pname == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if ".qkv_proj." in pname:
                expected |= {f"{pname}#{i}" for i in range(3)}
            elif ".gate_up_proj." in pname:
                expected |= {f"{pname}#{i}" for i in range(2)}
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise EngineError(
                "unknown_model", f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
            )
        self.pack_linear_weights()

    def pack_linear_weights(self) -> int:
        """Repack every projection's weight for the CPU's oneDNN kernels (a no-op elsewhere);
        returns how many were packed."""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))


def _shard_sizes(model: LlamaForCausalLM, fused_name: str) -> tuple[int, ...]:
    module_name = fused_name.rsplit(".", 1)[0]
    module = model.get_submodule(module_name.rsplit(".", 1)[0])
    return tuple(module.shard_sizes)  # type: ignore[arg-type]
