"""Benchmarks: scripts run as ``python -m bench.NAME`` from the repository root."""
