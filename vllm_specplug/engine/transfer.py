"""Copies between the host and the device, the way a step makes them.

- ``to_device``: host indices and masks go up through pinned memory, so the
  copy is asynchronous (from pageable memory CUDA stages it through a
  bounce buffer and the host waits). PyTorch's caching host allocator keeps
  the pinned block alive until the copy has run.
- ``read_back``: every device tensor the host needs at one point of a step
  comes back in one copy (one device->host synchronisation), packed as bytes
  and split again on the host. On a CPU device both are no-ops.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 8  # every part starts at a multiple of the widest element size


def to_device(x, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``x`` (list, numpy array or host tensor) as a ``dtype`` tensor on
    ``device``, uploaded from pinned memory on CUDA."""
    t = torch.as_tensor(np.asarray(x) if isinstance(x, list) else x, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def to_device_parts(parts, device: torch.device | str) -> list[torch.Tensor]:
    """Each of ``parts`` (integer lists or arrays) as an int64 tensor on
    ``device``, from one upload split on the device."""
    up = to_device(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]),
                   torch.long, device)
    at = np.cumsum([0] + [len(p) for p in parts])
    return [up[a:b] for a, b in zip(at[:-1], at[1:])]


def read_back(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Host copies of ``tensors`` (None stays None), in one device->host
    copy. Tensors already on the host are returned as they are."""
    live = [t for t in tensors if t is not None and not on_host(t)]
    if not live:
        return list(tensors)
    parts, spans, at = [], [], 0
    for t in live:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % _ALIGN
        parts.append(raw)
        if pad:
            parts.append(raw.new_zeros(pad))
        spans.append((at, raw.numel()))
        at += raw.numel() + pad
    flat = torch.cat(parts).cpu()  # the one synchronisation
    host = iter(flat[a : a + n].view(t.dtype).reshape(t.shape)
                for (a, n), t in zip(spans, live))
    return [t if t is None or on_host(t) else next(host) for t in tensors]


def on_host(t: torch.Tensor) -> bool:
    """Whether reading ``t`` costs no device->host copy."""
    return t.device.type == "cpu"
