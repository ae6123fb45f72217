"""Copies between the host and a rank's device (#29: host copies pinned and non-blocking, one
synchronisation for a step's results).

`upload`: a host tensor to the device. From pageable memory a copy to a GPU waits for the
device's stream before it starts; from pinned memory with `non_blocking` it is queued behind the
work already there and the host goes on launching. PyTorch's pinned-memory pool keeps the staging
buffer alive until its copy has run. On the CPU it is the tensor itself.

`download`: a step's results to host arrays — every tensor copied into pinned memory without
blocking, then one wait for the device (each `.cpu()` would wait once of its own).
"""

from __future__ import annotations

import numpy as np
import torch


def upload(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the host) on `device`, queued without blocking the host on a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def download(*tensors: torch.Tensor | None) -> list[np.ndarray | None]:
    """Host arrays of `tensors` (None stays None), with at most one wait for the device."""
    on_gpu = [t is not None and t.device.type == "cuda" for t in tensors]
    if not any(on_gpu):
        return [None if t is None else t.detach().numpy() for t in tensors]
    staged = []
    for t, gpu in zip(tensors, on_gpu, strict=True):
        if t is None or not gpu:
            staged.append(t)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        staged.append(host)
    torch.cuda.current_stream(tensors[on_gpu.index(True)].device).synchronize()
    return [None if t is None else t.numpy() for t in staged]
