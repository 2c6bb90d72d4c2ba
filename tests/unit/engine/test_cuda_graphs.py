"""Decode CUDA graphs: the bucket sizes, the static buffers' padding (checked on the CPU), the
torch backend skipping padded slots like the Triton kernel, and on CUDA (`gpu`): graph replay
gives the eager engine's tokens, padded buckets included, overlap on CUDA gives the plain
loop's tokens, bf16 by default, and a KV cache sized within `gpu_memory_utilization`."""

from __future__ import annotations

import pytest
import torch

from seedance.engine.attention.metadata import AttentionMetadata
from seedance.engine.attention.torch_backend import TorchBackend
from seedance.engine.cuda_graphs import DecodeGraphInputs, bucket_for, decode_buckets
from seedance.engine.sampling_params import SamplingParams


def test_buckets_cover_every_batch_size_up_to_the_maximum():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert decode_buckets(50)[-2:] == [48, 50]
    buckets = decode_buckets(64)
    for n in range(1, 65):
        b = bucket_for(buckets, n)
        assert (
            b is not None
            and b >= n
            and (buckets.index(b) == 0 or buckets[buckets.index(b) - 1] < n)
        )
    assert bucket_for(buckets, 65) is None


def test_static_inputs_take_a_step_and_pad_the_bucket():
    inputs = DecodeGraphInputs(8, 4, 16, torch.device("cpu"))
    inputs.input_ids.fill_(99)
    inputs.slot_mapping.fill_(7)
    inputs.seq_lens.fill_(5)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([33, 70, 5]),
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        seq_lens=torch.tensor([34, 7, 6], dtype=torch.int32),
        block_tables=torch.tensor([[2, 1], [4, 0], [0, 0]], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=34,
        block_size=16,
    )
    inputs.fill(4, torch.tensor([10, 11, 12]), torch.tensor([33, 6, 5]), meta)
    assert inputs.input_ids[:4].tolist() == [10, 11, 12, 0]
    assert inputs.positions[:4].tolist() == [33, 6, 5, 0]
    assert inputs.slot_mapping[:4].tolist() == [33, 70, 5, -1]
    assert inputs.seq_lens[:4].tolist() == [34, 7, 6, 0]
    assert inputs.block_tables[:3, :2].tolist() == [[2, 1], [4, 0], [0, 0]]
    graph_meta = inputs.meta(4, 1024)
    assert graph_meta.num_seqs == 4 and graph_meta.is_decode_only
    assert graph_meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="does not fit"):
        inputs.fill(2, torch.tensor([10, 11, 12]), torch.tensor([33, 6, 5]), meta)


def test_torch_backend_stores_nothing_for_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros(2, 4, 1, 8)
    key = torch.arange(3 * 8, dtype=torch.float32).view(3, 1, 8) + 1
    TorchBackend().store_kv(key, -key, k_cache, v_cache, torch.tensor([5, -1, 2]))
    flat_k, flat_v = k_cache.view(8, 1, 8), v_cache.view(8, 1, 8)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_k[2], key[2])
    assert torch.equal(flat_v[5], -key[0])
    assert int((flat_k != 0).any(dim=-1).sum()) == 2


class EagerReplay:
    """Stands in for `DecodeGraphs` on the CPU: the same static buffers and padding, with the
    forward run eagerly over the padded bucket instead of a graph replay."""

    def __init__(self, runner, buckets: list[int]) -> None:
        self.runner = runner
        self.buckets = buckets
        max_blocks = -(-runner.max_positions // runner.block_size)
        self.inputs = DecodeGraphInputs(buckets[-1], max_blocks, runner.block_size, runner.device)
        self.replayed: list[tuple[int, int]] = []

    def bucket_for(self, num_seqs: int) -> int | None:
        return bucket_for(self.buckets, num_seqs)

    def replay(self, bucket, input_ids, positions, meta):
        self.inputs.fill(bucket, input_ids, positions, meta)
        graph_meta = self.inputs.meta(bucket, self.runner.max_positions)
        model = self.runner.model
        hidden = model(self.inputs.input_ids[:bucket], self.inputs.positions[:bucket], graph_meta)
        self.replayed.append((input_ids.shape[0], bucket))
        return model.compute_logits(hidden).float()[: input_ids.shape[0]]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_steps_padded_to_a_bucket_give_the_eager_tokens(make_llm, backend):
    """Padding rows (slot -1, seq_len 0) leave the real rows' tokens unchanged, with the torch
    backend and with the Triton kernels (the interpreter on the CPU)."""
    ps = [[7 + i] * (3 + 5 * i) for i in range(7)]
    params = [
        SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(7)
    ]
    for overlap in (False, True) if backend == "torch" else (True,):  # the interpreter is slow
        eager = make_llm(overlap=overlap, attention_backend=backend).generate(ps, params)
        llm = make_llm(overlap=overlap, attention_backend=backend)
        fake = EagerReplay(llm.engine.runner, decode_buckets(8))
        llm.engine.runner.graphs = fake
        padded = llm.generate(ps, params)
        assert [o.token_ids for o in padded] == [o.token_ids for o in eager]
        # 7 sequences run in the 8 bucket, then fewer as they finish: 6, 5 -> 8; 4, 3 -> 4 ...
        assert {(n, b) for n, b in fake.replayed} >= {(7, 8), (5, 8), (3, 4), (1, 1)}
        assert all(n < b for n, b in fake.replayed if n not in (1, 2, 4, 8))


# ---- CUDA ------------------------------------------------------------------------------------


def _cuda_llm(make_llm, **kwargs):
    """A CUDA engine; `gpu_memory_utilization` counts what earlier engines of the test hold."""
    kwargs.setdefault("device", "cuda")
    kwargs.setdefault("dtype", "bfloat16")
    kwargs.setdefault("attention_backend", "triton")
    return make_llm(**kwargs)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(
            4, 512, (int(torch.randint(1, 200, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n)
    ]


@pytest.mark.gpu
def test_graph_replay_gives_the_eager_tokens(make_llm):
    ps = _prompts(11)  # 11 sequences replay in the 16 bucket, then fewer as they finish (8, 4, ...)
    params = [
        SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(11)
    ]
    eager = _cuda_llm(
        make_llm, enforce_eager=True, overlap=False, max_batch_size=16, gpu_memory_utilization=0.2
    )
    graphs = _cuda_llm(make_llm, overlap=False, max_batch_size=16, gpu_memory_utilization=0.4)
    assert eager.engine.runner.graphs is None
    runner = graphs.engine.runner
    assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 8, 16]
    a = eager.generate(ps, params)
    b = graphs.generate(ps, params)
    assert runner.graphs.num_replays > 0
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids


@pytest.mark.gpu
def test_overlap_on_cuda_gives_the_plain_loop_tokens(make_llm):
    ps = _prompts(9)
    greedy = [SamplingParams(max_tokens=20, temperature=0.0) for _ in range(6)]
    seeded = [
        SamplingParams(max_tokens=20, temperature=0.9, seed=i, ignore_eos=True) for i in range(3)
    ]
    plain = _cuda_llm(make_llm, overlap=False, gpu_memory_utilization=0.2)
    over = _cuda_llm(make_llm, gpu_memory_utilization=0.4)
    assert over.engine.overlap  # the default on CUDA
    a = plain.generate(ps, greedy + seeded)
    b = over.generate(ps, greedy + seeded)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason


@pytest.mark.gpu
def test_cuda_defaults_to_bf16_and_sizes_the_cache_within_the_memory_budget(make_llm):
    llm = make_llm(device="cuda", dtype="auto", gpu_memory_utilization=0.3)
    runner = llm.engine.runner
    assert runner.dtype is torch.bfloat16 and runner.kv_cache.dtype is torch.bfloat16
    total = torch.cuda.mem_get_info()[1]
    assert torch.cuda.memory_reserved() <= 0.3 * total
    assert runner.num_blocks > 0
    fp16 = make_llm(device="cuda", dtype="float16", gpu_memory_utilization=0.5)
    assert next(fp16.engine.runner.model.parameters()).dtype is torch.float16


def test_auto_dtype_is_bf16_on_cuda_and_the_checkpoints_half_type_when_fp16():
    from seedance.engine.model_runner import resolve_dtype

    assert resolve_dtype("auto", "cuda", "float32") is torch.bfloat16
    assert resolve_dtype("auto", "cuda", None) is torch.bfloat16
    assert resolve_dtype("auto", "cuda", "float16") is torch.float16
    assert resolve_dtype("float16", "cuda", "bfloat16") is torch.float16
    assert resolve_dtype("auto", "cpu", "bfloat16") is torch.float32
