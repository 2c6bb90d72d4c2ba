"""Tracing: the Chrome trace-event JSON (stage spans per step, one event per token with its
request, KV blocks and stage timings) and the queue-backlog warning."""

from __future__ import annotations

import json
import logging

from seedance.engine.sampling_params import SamplingParams
from seedance.engine.tracing import STAGES, QueueBacklogMonitor, TraceWriter


def test_trace_output_is_valid_chrome_trace_json(make_llm, tmp_path):
    path = tmp_path / "trace.json"
    llm = make_llm(trace_output=str(path))
    outs = llm.generate([[1, 2, 3], [4] * 40], SamplingParams(max_tokens=5, ignore_eos=True))
    llm.close()
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    tokens = [e for e in events if e.get("name") == "token"]
    assert len(tokens) == sum(len(o.token_ids) for o in outs) == 10
    for e in tokens:
        assert e["ph"] == "i" and isinstance(e["ts"], float)
        args = e["args"]
        assert args["request_id"] in {o.request_id for o in outs}
        assert args["kv_blocks"] and all(isinstance(b, int) for b in args["kv_blocks"])
        for stage in STAGES:
            assert f"{stage}_ms" in args
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["name"] for e in spans} == set(STAGES)
    assert all(e["dur"] >= 0 for e in spans)
    by_req = {}
    for e in tokens:
        by_req.setdefault(e["args"]["request_id"], []).append(e["args"]["index"])
    assert all(v == list(range(5)) for v in by_req.values())


def test_close_is_idempotent_and_empty_trace_is_valid(tmp_path):
    w = TraceWriter(tmp_path / "t.json")
    w.close()
    w.close()
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_backlog_warning_after_three_slow_steps_in_a_row(caplog):
    m = QueueBacklogMonitor()
    with caplog.at_level(logging.WARNING, logger="seedance.engine"):
        assert [m.observe(w) for w in (0.02, 0.02, 0.001, 0.02, 0.02)] == [False] * 5
        assert m.observe(0.03) is True
        assert m.observe(0.03) is False  # once per episode
    assert m.warnings == 1
    assert "15 ms" in caplog.text and "3 steps" in caplog.text
