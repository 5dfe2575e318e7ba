"""Copies from the host to a GPU that queue behind the work already there instead of waiting for it.

A plain copy to a GPU (`.to("cuda")`, `torch.tensor(..., device="cuda")`) waits for everything queued
on the device first, so a round that makes one waits there. From pinned memory the copy is queued like
a kernel; the caching host allocator keeps the pinned block until the copy has read it.
"""

from __future__ import annotations

import torch


def queued(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`: on a GPU a queued copy, elsewhere `t.to(device)`."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
