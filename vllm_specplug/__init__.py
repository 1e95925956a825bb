"""vllm-specplug: tree-based speculative decoding methods for vLLM."""

__version__ = "0.1.0"
