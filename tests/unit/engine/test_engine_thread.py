"""The engine thread: thread-safe submit/abort/pause/resume, one callback per step with all of
its outputs, synchronous request errors, abort and shutdown free everything."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from seedance.engine.config import EngineConfig
from seedance.engine.engine_interface import EngineInterface
from seedance.engine.engine_thread import EngineThread
from seedance.engine.errors import EngineError
from seedance.engine.outputs import RequestDelta, StepOutput
from seedance.engine.sampling_params import SamplingParams

TIMEOUT = 30.0


class Collector:
    """on_step callback recording every StepOutput and which thread delivered it."""

    def __init__(self) -> None:
        self.outputs: list[StepOutput] = []
        self.threads: set[str] = set()
        self.cond = threading.Condition()

    def __call__(self, out: StepOutput) -> None:
        with self.cond:
            self.outputs.append(out)
            self.threads.add(threading.current_thread().name)
            self.cond.notify_all()

    def deltas(self, rid: str) -> list[RequestDelta]:
        with self.cond:
            return [d for o in self.outputs for d in o.deltas if d.request_id == rid]

    def wait_finished(self, *rids: str) -> None:
        def done() -> bool:
            return all(any(d.finished for d in self.deltas(r)) for r in rids)

        with self.cond:
            assert self.cond.wait_for(done, TIMEOUT), f"not finished: {rids}"

    def wait_tokens(self, rid: str, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(
                lambda: sum(len(d.token_ids) for d in self.deltas(rid)) >= n, TIMEOUT
            )


@pytest.fixture
def engine(llama_dir) -> Iterator[tuple[EngineThread, Collector]]:
    et = EngineThread(
        EngineConfig(
            model=str(llama_dir),
            device="cpu",
            kv_cache_gb=0.01,
            block_size=16,
            max_queued_requests=4,
        )
    )
    col = Collector()
    et.start(col)
    assert et.wait_ready(TIMEOUT) and et.is_ready()
    yield et, col
    et.shutdown()
    assert not et.engine.requests
    bm = et.engine.block_manager
    assert bm.free_block_count == bm.num_blocks, "KV blocks leaked"


def test_it_implements_the_engine_interface(engine):
    et, _ = engine
    iface: EngineInterface = et
    assert iface.model_name and iface.max_model_len == 1024


def test_requests_from_other_threads_stream_to_completion(engine):
    et, col = engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    threads = [
        threading.Thread(target=et.submit, args=(f"r{i}", [i + 2, 3, 4], params)) for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    col.wait_finished("r0", "r1", "r2", "r3")
    for i in range(4):
        ds = col.deltas(f"r{i}")
        assert [d.index for d in ds] == list(range(8))
        assert ds[-1].finish_reason == "length" and ds[-1].usage.completion_tokens == 8
        assert ds[0].first_token_time is not None and ds[0].queue_time is not None
    assert col.threads == {"seedance-engine"}


def test_one_callback_per_step_holding_all_of_its_outputs(engine):
    et, col = engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(3):
        et.submit(f"s{i}", [5, 6, 7], params)
    col.wait_finished("s0", "s1", "s2")
    steps = [o.step for o in col.outputs]
    assert steps == sorted(set(steps))  # one call per step, in order
    for o in col.outputs:
        rids = [d.request_id for d in o.deltas]
        assert len(rids) == len(set(rids))  # each request at most once per step
    assert any(len(o.deltas) == 3 for o in col.outputs)  # the batch went out together


def test_abort_frees_everything_and_sends_cancelled(engine):
    et, col = engine
    et.submit("long", [9, 9], SamplingParams(max_tokens=500, ignore_eos=True))
    col.wait_tokens("long", 3)
    et.abort("long")
    col.wait_finished("long")
    final = col.deltas("long")[-1]
    assert final.finish_reason == "cancelled" and final.token_ids == []
    et.abort("long")  # twice, and unknown ids: ignored
    et.abort("never-existed")
    et.submit("after", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    col.wait_finished("after")
    bm = et.engine.block_manager
    assert bm.free_block_count == bm.num_blocks


def test_pause_holds_tokens_and_resume_continues(engine):
    et, col = engine
    et.submit("p", [4, 4, 4], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    col.wait_tokens("p", 2)
    et.pause("p")
    et.submit("marker", [1], SamplingParams(max_tokens=3, ignore_eos=True))
    col.wait_finished("marker")  # steps ran while "p" was paused
    n = sum(len(d.token_ids) for d in col.deltas("p"))
    et.submit("marker2", [1], SamplingParams(max_tokens=3, ignore_eos=True))
    col.wait_finished("marker2")
    assert sum(len(d.token_ids) for d in col.deltas("p")) == n
    assert et.stats().num_paused == 1
    et.resume("p")
    col.wait_finished("p")
    tokens = [t for d in col.deltas("p") for t in d.token_ids]
    assert len(tokens) == 40


def test_submit_errors_are_raised_synchronously(engine):
    et, _ = engine
    with pytest.raises(EngineError) as err:
        et.submit("big", [1] * 1024, SamplingParams())
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(EngineError) as err:
        et.submit("bad", [1], "not params")  # type: ignore[arg-type]
    assert err.value.code == "invalid_request" and err.value.param == "params"
    with pytest.raises(EngineError) as err:
        et.submit("neg", [1], SamplingParams(), deadline_s=-1)
    assert err.value.param == "deadline_s"


def test_duplicate_live_request_id_is_refused(engine):
    et, col = engine
    et.submit("dup", [1], SamplingParams(max_tokens=300, ignore_eos=True))
    with pytest.raises(EngineError) as err:
        et.submit("dup", [1], SamplingParams())
    assert err.value.param == "request_id"
    et.abort("dup")
    col.wait_finished("dup")


def test_full_queue_is_overloaded(llama_dir):
    et = EngineThread(
        EngineConfig(
            model=str(llama_dir),
            device="cpu",
            kv_cache_gb=0.01,
            block_size=16,
            max_batch_size=1,
            max_queued_requests=3,
        )
    )
    col = Collector()
    gate, in_callback = threading.Event(), threading.Event()

    def blocking(out: StepOutput) -> None:
        in_callback.set()
        gate.wait(TIMEOUT)  # hold the engine thread so submits pile up
        col(out)

    et.start(blocking)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    et.submit("first", [1, 2], params)
    assert in_callback.wait(TIMEOUT)  # "first" holds the batch's one slot
    for i in range(3):
        et.submit(f"q{i}", [1, 2], params)
    with pytest.raises(EngineError) as err:
        et.submit("one-too-many", [1, 2], params)
    assert err.value.code == "overloaded"
    gate.set()
    col.wait_finished("first", "q0", "q1", "q2")
    et.submit("later", [1, 2], params)  # the queue drained: accepted again
    col.wait_finished("later")
    et.shutdown()
    assert et.engine.block_manager.free_block_count == et.engine.block_manager.num_blocks


def test_encode_and_chat_template(engine):
    et, _ = engine
    assert et.encode("hello") == et.engine.tokenizer.hf.encode("hello")
    ids = et.encode_chat([{"role": "user", "content": "hi"}])
    text = et.engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(EngineError) as err:
        et.encode_chat([{"role": "wizard", "content": "x"}])
    assert err.value.param == "messages[0].role"


def test_token_text_names_one_token_as_it_decodes_alone(engine):
    et, _ = engine
    ids = et.engine.tokenizer.hf.encode("hello é", add_special_tokens=False)
    texts = [et.token_text(t) for t in ids]
    assert "".join(texts).startswith("hello")
    assert any("\ufffd" in text for text in texts)  # é is split into byte tokens
    im_end = et.engine.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert et.token_text(im_end) == "<|im_end|>"  # special tokens are named, not dropped


def test_shutdown_cancels_live_requests_and_is_idempotent(llama_dir):
    et = EngineThread(
        EngineConfig(model=str(llama_dir), device="cpu", kv_cache_gb=0.01, block_size=16)
    )
    col = Collector()
    et.start(col)
    et.submit("x", [1, 2], SamplingParams(max_tokens=1000, ignore_eos=True))
    col.wait_tokens("x", 1)
    et.shutdown()
    et.shutdown()
    assert col.deltas("x")[-1].finish_reason == "cancelled"
    assert not et.is_ready()
    bm = et.engine.block_manager
    assert bm.free_block_count == bm.num_blocks
    with pytest.raises(EngineError):
        et.submit("y", [1], SamplingParams())
