"""Servers started by these tests get a 1 GiB KV cache (plenty for their few
short requests), whatever the environment asks for. vLLM's CPU backend
refuses to start when the NUMA node's *free* memory is below the KV cache
it is asked for, and free memory excludes the page cache: after the test
run's set-up and compilations have filled the cache, a 4 GiB request failed
on a 24 GiB machine with 2.3 GiB free and most of the rest reclaimable."""

import pytest


@pytest.fixture(scope="package", autouse=True)
def _small_kv_cache():
    # Package scope, so it is set before the module-scoped server fixtures.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield
