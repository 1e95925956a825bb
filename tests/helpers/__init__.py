"""Helpers shared by several test modules (prompts, engine checks, contexts,
statistics), so that no test imports another test module's names."""
