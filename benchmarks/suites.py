"""The benchmark's prompt suites: :mod:`vllm_specplug.suites` (the package
holds them so its tools calibrate on the same prompts without this folder)."""

from vllm_specplug.suites import (BUILTIN, SPECBENCH_CATEGORIES, Suite, SuiteUnavailable,
                                  load, shared_dir, spec_bench_path, specbench_category,
                                  tokenize)

__all__ = ["BUILTIN", "SPECBENCH_CATEGORIES", "Suite", "SuiteUnavailable", "load",
           "shared_dir", "spec_bench_path", "specbench_category", "tokenize"]
