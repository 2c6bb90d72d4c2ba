"""The server's Prometheus metrics: exactly the `seedance_` families of the server issue, in a
private registry (never prometheus_client's global one). Engine gauges and counters are read
from `engine.stats()` at scrape time; latencies are observed by the engine bridge; protocol
counters are incremented by the gateways.

Everything here is touched from the trio thread only, so the instruments are plain numbers
(no locks); the scrape also runs in the trio thread."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from seedance.engine.outputs import EngineStats

PREFIX = "seedance_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class Histogram:
    """Cumulative-bucket histogram for one thread: `observe` is a bisect and two adds."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def family(self) -> HistogramMetricFamily:
        cumulative: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            total += count
            cumulative.append((repr(float(bound)), total))
        total += self.counts[-1]
        cumulative.append(("+Inf", total))
        return HistogramMetricFamily(
            self.name, self.documentation, buckets=cumulative, sum_value=self.sum
        )


class ServerMetrics(Collector):
    """All `seedance_` metrics. `engine_stats` is called at each scrape."""

    def __init__(self, engine_stats: Callable[[], EngineStats] | None = None) -> None:
        self.engine_stats = engine_stats
        self.registry = CollectorRegistry(auto_describe=False)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            LATENCY_BUCKETS,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Seconds between consecutive deltas of a request, per token.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Seconds from a request's arrival to its end.",
            LATENCY_BUCKETS,
        )
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Seconds a request waited for admission and for its first engine step.",
            LATENCY_BUCKETS,
        )
        self.ws_connections = 0
        """Open WebSocket connections (the WebSocket gateway adds and subtracts)."""
        self.sessions_resumed = 0
        self.frames_retransmitted = 0
        self.protocol_errors: dict[str, int] = {}
        self.requests_waiting_admission: Callable[[], int] = lambda: 0
        """Requests queued in the server before the engine (set by the engine bridge)."""
        self.registry.register(self)

    def protocol_error(self, code: str) -> None:
        """Count one protocol error by its §7 code."""
        self.protocol_errors[code] = self.protocol_errors.get(code, 0) + 1

    def render(self) -> bytes:
        """The exposition text for `GET /metrics`."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        for histogram in (
            self.time_to_first_token,
            self.inter_token_latency,
            self.e2e_request_latency,
            self.request_queue_time,
        ):
            yield histogram.family()
        stats = self.engine_stats() if self.engine_stats is not None else None
        running = stats.num_running if stats else 0
        waiting = stats.num_waiting + stats.num_paused if stats else 0
        waiting += self.requests_waiting_admission()
        yield _gauge("num_requests_running", "Requests in the engine's running batch.", running)
        yield _gauge(
            "num_requests_waiting",
            "Requests admitted but not running: queued in the server or the engine, or paused.",
            waiting,
        )
        yield _gauge(
            "kv_cache_usage_ratio",
            "Fraction of KV cache blocks in use.",
            stats.kv_cache_usage if stats else 0.0,
        )
        yield _gauge("ws_connections", "Open WebSocket connections.", self.ws_connections)
        yield _counter(
            "prefix_cache_hits",
            "Prompt blocks found in the prefix cache.",
            stats.prefix_cache_hits if stats else 0,
        )
        yield _counter(
            "prefix_cache_queries",
            "Prompt blocks looked up in the prefix cache.",
            stats.prefix_cache_queries if stats else 0,
        )
        yield _counter(
            "num_preemptions",
            "Sequences preempted (recomputed) for lack of KV blocks.",
            stats.num_preemptions if stats else 0,
        )
        yield _counter(
            "prompt_tokens",
            "Prompt tokens scheduled by the engine.",
            stats.prompt_tokens_total if stats else 0,
        )
        yield _counter(
            "generation_tokens",
            "Tokens generated by the engine.",
            stats.generation_tokens_total if stats else 0,
        )
        yield _counter(
            "sessions_resumed",
            "Protocol sessions resumed on a new connection.",
            self.sessions_resumed,
        )
        yield _counter(
            "frames_retransmitted", "Protocol frames sent again.", self.frames_retransmitted
        )
        errors = CounterMetricFamily(
            PREFIX + "protocol_errors", "Protocol errors by code (§7).", labels=["code"]
        )
        for code, value in sorted(self.protocol_errors.items()):
            errors.add_metric([code], value)
        yield errors


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, documentation, value=value)
