"""Specplug methods: each a short composition of engine/ and sources/ pieces."""
