"""Host copies of a checkpoint's tensors for an asynchronous save (trainers.checkpoint.sharded.Checkpointer): kept
from one save to the next, pinned when the tensors are on a GPU."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def stage(state: Any, buffers: dict[str, torch.Tensor], key: str, device: torch.device) -> Any:
    """A copy of `state` whose tensors live in host buffers that are reused by the next save (pinned when the
    tensors are on a GPU: the copy is then a DMA). DTensors stay DTensors (same mesh and placements) around their
    local shard's copy, so DCP plans the same write. On a GPU the copies are queued on the current stream, behind
    what training queued there, and the host waits once for all of them (not once per tensor: thousands of waits
    for a large model's optimizer state), so the copies are whole when this returns."""
    out = _stage(state, buffers, key)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return out


Spec = tuple[str, torch.Size, torch.dtype, bool]
"""A host buffer to allocate: its key (as `stage` names it), shape, dtype, and whether to pin it."""


def specs(state: Any, key: str = "") -> list[Spec]:
    """The host buffers `stage` will use for `state`'s tensors, read on the training thread (a state dict's
    tensors are live), so that another thread can allocate them."""
    if isinstance(state, dict):
        return [spec for k, v in state.items() for spec in specs(v, f"{key}.{k}")]
    t = state.to_local() if isinstance(state, DTensor) else state
    return [(key, t.shape, t.dtype, t.is_cuda)] if isinstance(t, torch.Tensor) else []


def reserve(wanted: list[Spec], buffers: dict[str, torch.Tensor]) -> None:
    """Allocate (not fill) those buffers. Pinning a 1b model's state (14.6 GB) was most of the 7.6 s its first
    background save held training on an H200, while the optimizer step waited for the copy."""
    for key, shape, dtype, pin in wanted:
        if key not in buffers:
            buffers[key] = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


def _stage(state: Any, buffers: dict[str, torch.Tensor], key: str) -> Any:
    if isinstance(state, dict):
        return {k: _stage(v, buffers, f"{key}.{k}") for k, v in state.items()}
    if isinstance(state, DTensor):
        # The constructor, not DTensor.from_local: that would copy the host buffer back onto the mesh's device.
        return DTensor(_stage_tensor(state.to_local(), buffers, key), state._spec, requires_grad=False)
    if isinstance(state, torch.Tensor):
        return _stage_tensor(state, buffers, key)
    return copy.deepcopy(state)


def _stage_tensor(t: torch.Tensor, buffers: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    buf = buffers.get(key)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        buffers[key] = buf
    buf.copy_(t.detach(), non_blocking=t.is_cuda)
    return buf
