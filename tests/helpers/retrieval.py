"""Hand-made vectors of the retrieval and ``adapld`` unit tests."""

from __future__ import annotations

import numpy as np
import torch

V, H = 64, 4
"""Vocabulary size and hidden size of the hand-made memories."""


def unit(i, dim=H):
    """The ``i % dim``-th unit vector (float32)."""
    v = np.zeros(dim, dtype=np.float32)
    v[i % dim] = 1.0
    return v


def embeddings(similar=()):
    """One-hot token embeddings; ``similar`` pairs (a, b, cos) get cosine cos."""
    e = torch.eye(V)
    for a, b, c in similar:
        e[b] = c * e[a] + (1 - c * c) ** 0.5 * torch.eye(V)[b]
    return e
