"""Fixtures shared by the method engine tests."""

from __future__ import annotations

import pytest

from tests.conftest import plain_greedy
from tests.helpers.host_reads import reads  # noqa: F401 (fixture)
from tests.helpers.prompts import COPY_MAX_TOKENS, copy_prompts


@pytest.fixture(scope="module")
def copy_baseline(ref_model):
    """Eight copy prompts and their plain greedy outputs (``COPY_MAX_TOKENS``)."""
    prompts = copy_prompts(ref_model, 8)
    return prompts, plain_greedy(ref_model, prompts, COPY_MAX_TOKENS)
