"""Standalone benchmarks; each returns its rows (JSON-able dicts) and prints a table on rank 0."""
__all__ = ["allreduce"]
