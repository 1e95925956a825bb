"""`eagle3_tree`: an EAGLE-3 head drafting EAGLE-2-style dynamic trees.

The whole method is the EAGLE-3 tree drafter
(:mod:`vllm_specplug.sources.eagle3_drafter`) with its options: every
verified row feeds the head, and each drafting request gets the head's
top-k tree, best path first.
"""

from __future__ import annotations

from vllm_specplug.sources.eagle3_drafter import Eagle3Drafter, Eagle3DrafterConfig


class Eagle3TreeConfig(Eagle3DrafterConfig):
    """The drafter's options, nothing more."""


class Eagle3TreeProposer(Eagle3Drafter):
    name = "eagle3_tree"
    config_cls = Eagle3TreeConfig
