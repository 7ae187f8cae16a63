"""Benchmarks (see docs/benchmarks.md). Each is ``python -m bench.NAME [--quick]``."""
