"""Structured log lines, the server trace file and the metrics registry."""

from __future__ import annotations

import io
import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from seedance.engine.outputs import EngineStats
from seedance.server.ops.metrics import Histogram, ServerMetrics
from seedance.server.ops.server_trace import ServerTrace, server_trace_path
from seedance.server.ops.structured_log import configure_logging, log_event


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger("seedance")
    saved = (root.handlers[:], root.level, root.propagate)
    yield
    root.handlers[:], root.level, root.propagate = saved


def test_log_lines_are_key_value_with_quoting(restore_logging: None) -> None:
    out = io.StringIO()
    configure_logging("info", out)
    logger = logging.getLogger("seedance.test")
    log_event(logger, "request_done", path="/v1/x", note="two words", n=3)
    log_event(logger, "hidden", level=logging.DEBUG)
    line = out.getvalue().strip()
    assert "\n" not in line
    assert "level=info logger=seedance.test event=request_done path=/v1/x" in line
    assert 'note="two words" n=3' in line
    assert line.startswith("ts=") and "Z " in line


def test_server_trace_is_a_valid_trace_event_document(tmp_path: Path) -> None:
    path = server_trace_path(str(tmp_path / "t.json"))
    trace = ServerTrace(path)
    for i in range(1200):  # crosses the flush threshold
        trace.sent("frame", f"r{i % 3}", tokens=1, nbytes=40, seq=i)
    trace.close()
    trace.close()
    events = json.loads(Path(path).read_text())["traceEvents"]
    frames = [e for e in events if e["name"] == "frame"]
    assert len(frames) == 1200 and frames[5]["args"]["seq"] == 5
    assert all(a["ts"] <= b["ts"] for a, b in itertools.pairwise(frames))


def test_histogram_buckets_are_cumulative() -> None:
    histogram = Histogram("h", "doc", (0.1, 1.0))
    for value in (0.05, 0.5, 0.5, 5.0):
        histogram.observe(value)
    family = histogram.family()
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name == "h_bucket"}
    assert buckets == {"0.1": 1, "1.0": 3, "+Inf": 4}
    assert histogram.count == 4 and histogram.sum == 6.05


def test_engine_stats_are_read_at_scrape_time() -> None:
    stats = EngineStats(num_running=3, num_waiting=2, num_paused=1, kv_blocks_total=10,
                        kv_blocks_free=4, prefix_cache_queries=8, prefix_cache_hits=5,
                        num_preemptions=2, prompt_tokens_total=100,
                        generation_tokens_total=200, steps=50)
    metrics = ServerMetrics(lambda: stats)
    metrics.requests_waiting_admission = lambda: 4
    metrics.ws_connections = 2
    metrics.sessions_resumed = 1
    metrics.frames_retransmitted = 7
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples if not s.labels
    }
    assert values["seedance_num_requests_running"] == 3
    assert values["seedance_num_requests_waiting"] == 2 + 1 + 4
    assert abs(values["seedance_kv_cache_usage_ratio"] - 0.6) < 1e-9
    assert values["seedance_prefix_cache_hits_total"] == 5
    assert values["seedance_prefix_cache_queries_total"] == 8
    assert values["seedance_num_preemptions_total"] == 2
    assert values["seedance_generation_tokens_total"] == 200
    assert values["seedance_ws_connections"] == 2
    assert values["seedance_sessions_resumed_total"] == 1
    assert values["seedance_frames_retransmitted_total"] == 7


def test_each_server_has_its_own_registry() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    a.time_to_first_token.observe(1.0)
    assert b"seedance_time_to_first_token_seconds_count 0.0" in b.render()
