"""Benchmarks (see ../shared/spec/benchmarks.md). Each is ``python -m bench.NAME [--quick]``."""
