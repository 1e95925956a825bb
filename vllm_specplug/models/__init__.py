"""Model folders for tests and benchmarks (materialized locally, no model hub)."""

from vllm_specplug.models.reference import reference_model_path
from vllm_specplug.models.tiny import tiny_model_path

__all__ = ["reference_model_path", "tiny_model_path"]
