"""Benchmark drivers behind ``moe-fp8 bench`` (installed as ``moe_fp8.benchmarks``)."""
