"""The runner layer: the only code that touches vLLM internals."""
