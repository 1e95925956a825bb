"""Benchmark harness of vllm_specplug: ``python -m benchmarks.run --help``."""
