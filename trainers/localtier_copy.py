"""The node-local tier's copy of a rank's state to host memory, overlapped with training (trainers.localtier): the
loop no longer waits for it. Before, each save copied every tensor in the loop (`to_cpu`, fresh allocations each
time: ~6 ms of the ~12 ms a save cost the classifier's 8.7 ms step on the 2-core test host).

Host buffers are kept per tensor from one save to the next (no allocation or page faults after the first), pinned
when the tensors are on a GPU. Only the optimizer's step changes the parameters and the optimizer's state, so the
copy may run while the next step's forward and backward do: on the CPU the writer thread copies them; on a GPU the
copies are queued non-blocking on a side CUDA stream (behind an event recorded on the training stream at the save),
and the writer waits on their event before it encodes. Before each optimizer step a pre-hook (registered once on the
optimizers found in the states) waits until the copies are queued (GPU: the training stream then waits on the
copies' event, the host does not) or done (CPU). What a forward may change (running statistics, DDP's broadcast
buffers: stateful.forward_changes) is copied at the save itself, on the training stream; the small states, RNG
streams and position are deep-copied there too (a few KB). With no optimizer found, the save waits for the copy.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from trainers.checkpoint.stateful import Stateful


def host_buffer(shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """One host buffer (pinned for a GPU's tensors: the copy is then a DMA that overlaps compute)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def optimizers_of(states: Mapping[str, Stateful]) -> list[Optimizer]:
    """The optimizers behind the states (trainers.checkpoint.stateful.OptimizerState keeps its `optimizer`)."""
    found = [getattr(part, "optimizer", part) for part in states.values()]
    return [o for o in found if isinstance(o, Optimizer)]


class HostCopy:
    """One rank's host copy of its tensors for the tier: `start` at a save (loop), `finish` in the writer thread,
    `hold` before each optimizer step (the pre-hook)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}
        self.queued = threading.Event()
        """Set when the copies of the save in flight are done (CPU) or queued on the side stream (GPU)."""
        self.queued.set()
        self.later: list[tuple[dict[str, Any], str, str, torch.Tensor]] = []
        """What the writer copies: (the payload's dict, its key, the buffer's key, the live tensor)."""
        self.ready: Any = None  # GPU: the training stream's event at the save
        self.done: Any = None  # GPU: the side stream's event after the copies
        self.stream: Any = None
        self.hooked: dict[int, RemovableHandle] = {}
        self.guard = False
        """A save's copy may still be in flight: the next optimizer step waits for it."""

    def buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[key] = host_buffer(t.shape, t.dtype, self.cuda)
        return buf

    def start(self, tensors: dict[str, Any], now: Mapping[str, frozenset[str]],
              states: Mapping[str, Stateful]) -> dict[str, Any]:
        """The tree of host buffers the writer will encode: what a forward changes copied now, the rest left to
        `finish`. Returns without waiting for the rest only when a pre-hook guards every optimizer."""
        hooked = self.hook(optimizers_of(states))
        self.queued.clear()
        self.later, self.done, self.guard = [], None, True
        out: dict[str, Any] = {}
        for name, part in tensors.items():
            out[name] = self.plan(part, name, name, now.get(name, frozenset()))
            if isinstance(part, torch.Tensor):  # a part that is one tensor: never changed by a forward
                self.later.append((out, name, name, local(part)))
        if self.cuda:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(self.device))
        if not hooked:
            self.finish()
        return out

    def plan(self, state: Any, key: str, name: str, now: frozenset[str], top: str = "") -> Any:
        if isinstance(state, dict):
            out: dict[str, Any] = {}
            for k, v in state.items():
                out[k] = self.plan(v, f"{key}.{k}", name, now, top or k)
                if isinstance(v, torch.Tensor) and (top or k) not in now:
                    self.later.append((out, k, key + "." + k, local(v)))  # its buffer: the writer's to fill in
            return out
        if not isinstance(state, torch.Tensor):
            return state
        if top not in now:
            return None
        t = local(state)
        buf = self.buffer(key, t)
        buf.copy_(t, non_blocking=self.cuda)  # on the training stream, before the next forward
        return buf

    def finish(self) -> None:
        """The writer thread (or `start`, unguarded): the buffers of the rest allocated (the first time: pinning a
        large state takes seconds) and filled; on a GPU, the copies queued on the side stream and waited for here,
        after letting the optimizer's step go on. Never leaves `queued` unset."""
        try:
            for tree, k, key, t in self.later:
                tree[k] = self.buffer(key, t)
            if self.cuda and self.later:
                self.queue_on_side_stream()
            else:
                for tree, k, _, t in self.later:
                    tree[k].copy_(t)
        finally:
            self.later = []
            self.queued.set()
        if self.cuda:
            (self.done or self.ready).synchronize()  # the side stream's copies, else those queued at the save

    def queue_on_side_stream(self) -> None:
        torch.cuda.set_device(self.device)  # the current device is per thread
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.ready)
            for tree, k, _, t in self.later:
                tree[k].copy_(t, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(self.stream)

    def hold(self, *_: Any) -> None:
        """Before an optimizer step: the save in flight must have read the tensors the step changes (once a save:
        the other steps pass on a flag)."""
        if not self.guard:
            return
        self.queued.wait()
        if self.cuda and self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)
        self.guard = False

    def hook(self, optimizers: list[Optimizer]) -> bool:
        """Register `hold` once on each optimizer; whether there is at least one."""
        for opt in optimizers:
            if id(opt) not in self.hooked:
                self.hooked[id(opt)] = opt.register_step_pre_hook(self.hold)
        return bool(optimizers)

    def close(self) -> None:
        for handle in self.hooked.values():
            handle.remove()
        self.hooked.clear()
