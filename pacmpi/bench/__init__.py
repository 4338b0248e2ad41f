"""Standalone benchmarks; each returns its rows (JSON-able dicts) and prints a table on rank 0.
:mod:`pacmpi.bench.harness` holds what every benchmark driver shares: timing, statistics, tables
and JSON reports."""
__all__ = ["allreduce"]
