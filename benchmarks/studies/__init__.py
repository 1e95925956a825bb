"""One-off studies: each answers one question about a method or the machine (see docs/benchmarks.md)."""
