"""Helpers for tests and benchmarks: random-weight real-architecture checkpoints."""
